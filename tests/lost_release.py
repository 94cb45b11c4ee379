"""A scale --ps whose request one shard never answers (a release, or an import): the moves that
the PS tests fail on purpose."""

from __future__ import annotations

import threading

from elastic_step.ps import moves


def move_losing_a_release(shard: int = 0):
    """A stand-in for moves.move that runs the real move but for `shard`'s first release request
    (shard 0 gives rows away in any growth), which fails as a shard that does not answer it
    would: it keeps the stale copies of what it gave away. The other shards' releases, sent
    beside it from their own threads, and the rest of the move go as they would."""
    return move_losing_a_request("release", shard)


def move_losing_a_request(op: str, shard: int):
    """A stand-in for moves.move that runs the real move but for `shard`'s first `op` request,
    which fails as a shard that does not answer it would (an import lost: the move stops with
    rows still on their way, the new owner waiting for them)."""
    lost, guard = [], threading.Lock()

    def losing(call, old, new, deadline_s=120.0):
        def asking(index, header, *arrays):
            with guard:
                lose = header["op"] == op and index == shard and not lost
                if lose:
                    lost.append(index)
            if lose:
                raise moves.PsError(f"shard {index} did not answer {op}")
            return call(index, header, *arrays)
        return moves.move(asking, old, new, deadline_s)

    return losing
