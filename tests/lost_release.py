"""A scale --ps whose release one shard never answers: the move that the PS tests fail on purpose."""

from __future__ import annotations

from elastic_step.ps import moves


def move_losing_a_release():
    """A stand-in for moves.move that runs the real move but for the first release request,
    which fails as a shard that does not answer it would; the shards it was not sent to, and the
    rest of the move, go as they would."""
    lost: list[int] = []

    def losing(call, old, new, deadline_s=120.0):
        def asking(shard, header, *arrays):
            if header["op"] == "release" and not lost:
                lost.append(shard)
                raise moves.PsError(f"shard {shard} did not answer release")
            return call(shard, header, *arrays)
        return moves.move(asking, old, new, deadline_s)

    return losing
