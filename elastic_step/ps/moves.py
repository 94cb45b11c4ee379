"""Moving virtual shards between running shard processes (`scale --ps N`), while workers train.

Only the virtual shards that change owner move (routing.py's `resized`: about 1/N of them):

1. adopt: every shard takes the next routing epoch. From then on each refuses requests made
   under the old epoch (sending its routing with the refusal, so clients re-route at once) and
   refuses the virtual shards it gains as MOVING until they arrive. Nothing else pauses.
2. export, import: per (old owner, new owner) pair, a few virtual shards at a time, the old
   owner hands over their rows, optimizer slots, counters and applied keys, as they stand in
   its memory (every update it accepted: the flush), and the new owner installs them,
   snapshots, and serves them. A re-sent import is dropped (state.py), so every step may be
   retried after a lost reply or a relaunched shard.
3. release: every shard forgets the rows it gave away and snapshots.

The applied keys move with the rows because a push's parts can straddle the epoch change: one
part applied by a shard under the old epoch, another refused and re-sent under the new one to
the virtual shard's new owner, which must apply it to the moved rows and to no others
(applied.py's AppliedGroups).

`call(shard, header, *arrays)` sends one request to one shard (with the job token) and returns
its (header, body); a shard that does not answer is asked again until `deadline_s`.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from elastic_step.ps import wire
from elastic_step.ps.api import PsError, ShardUnavailable, Status
from elastic_step.ps.routing import RoutingTable

Call = Callable[..., tuple[dict, bytearray]]
CHUNK = 16  # virtual shards per export/import at most: bounds each moved one's wait
# An export's bytes per message: a quarter of what a frame may carry, for virtual shards that hold
# more rows than the average and for the applied keys that travel with the rows.
MESSAGE_BUDGET = wire.MAX_BODY // 4


@dataclass
class MoveReport:
    epoch: int = 0
    virtual_shards: int = 0
    moved: int = 0  # virtual shards that changed owner
    rows_total: int = 0  # rows the shards held before, over all tables
    rows_moved: int = 0
    seconds: float = 0.0
    pauses_s: list[float] = field(default_factory=list)  # per moved virtual shard: refused until installed

    def to_json(self) -> dict:
        pauses = self.pauses_s or [0.0]
        return {"epoch": self.epoch, "virtual_shards": self.virtual_shards, "moved": self.moved,
                "rows_total": self.rows_total, "rows_moved": self.rows_moved, "seconds": round(self.seconds, 3),
                "pause_max_s": round(max(pauses), 3), "pause_mean_s": round(float(np.mean(pauses)), 3)}


def plan(old: RoutingTable, new: RoutingTable) -> dict[tuple[int, int], list[int]]:
    """(old owner, new owner) -> the virtual shards that move between them."""
    moves: dict[tuple[int, int], list[int]] = {}
    for v in np.flatnonzero(old.owners != new.owners).tolist():
        moves.setdefault((int(old.owners[v]), int(new.owners[v])), []).append(v)
    return moves


def stats_sum(stats: dict, key: str) -> int:
    """A shard's `stats` reply summed over its tables: its "rows" or its "bytes"."""
    return sum(int(table[key]) for table in stats["tables"].values())


def export_parts(vshards: list[int], shard_bytes: int, owned: int, most: int | None = None) -> list[list[int]]:
    """`vshards` of one shard in groups whose export fits a message. Rows are spread over the
    virtual shards by hash, so each of the `owned` holds about `shard_bytes / owned` (the shard's
    `stats` bytes: its tables' capacity, an upper bound); `most`: no more per group than that."""
    per_vshard = shard_bytes / max(owned, 1)
    size = max(1, int(MESSAGE_BUDGET // max(per_vshard, 1.0)))
    size = min(size, most or size, max(len(vshards), 1))
    return [vshards[i : i + size] for i in range(0, len(vshards), size)]


def ask(call: Call, shard: int, header: dict, *arrays: np.ndarray, deadline_s: float = 120.0) -> tuple[dict, bytearray]:
    """One request, sent again while the shard does not answer (relaunching); refused: PsError."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            reply, body = call(shard, header, *arrays)
        except (OSError, wire.FrameError) as exc:
            if time.monotonic() > deadline:
                raise ShardUnavailable(f"shard {shard} did not answer {header['op']} for {deadline_s:.0f} s: {exc}") from exc
            time.sleep(0.2)
            continue
        if reply.get("status") != Status.OK:
            raise PsError(f"shard {shard} refused {header['op']}: {reply.get('status')} {reply.get('detail', '')}")
        return reply, body


def _on_each(shards: range, request: Callable[[int], object]) -> None:
    """One request to every shard at once (each takes a snapshot: their fsyncs overlap); `call`
    is used from one thread per shard, so each connection still carries one request at a time."""
    with ThreadPoolExecutor(max_workers=len(shards)) as pool:
        for done in [pool.submit(request, shard) for shard in shards]:
            done.result()


def release(call: Call, shards: range, deadline_s: float = 120.0) -> None:
    """Step 3: every shard forgets the rows it gave away, and snapshots (a release asked again
    drops nothing more: a move finished later asks it once more of every shard)."""
    _on_each(shards, lambda shard: ask(call, shard, {"op": "release"}, deadline_s=deadline_s))


def move(call: Call, old: RoutingTable, new: RoutingTable, deadline_s: float = 120.0) -> MoveReport:
    """Move the virtual shards whose owner differs from `old` to `new` (steps 1-3 above)."""
    started = time.monotonic()
    report = MoveReport(new.epoch, len(new.owners), int((old.owners != new.owners).sum()))
    everyone = range(max(old.shards, new.shards))
    held = {}  # shard -> its tables' bytes
    for shard in range(old.shards):
        stats, _ = ask(call, shard, {"op": "stats"}, deadline_s=deadline_s)
        report.rows_total += stats_sum(stats, "rows")
        held[shard] = stats_sum(stats, "bytes")
    adopted = time.monotonic()
    _on_each(everyone, lambda shard: ask(call, shard, {"op": "adopt", "routing": new.to_json()}, deadline_s=deadline_s))
    for (source, target), vshards in plan(old, new).items():
        for part in export_parts(vshards, held[source], int((old.owners == source).sum()), most=CHUNK):
            reply, body = ask(call, source, {"op": "export", "vshards": part}, deadline_s=deadline_s)
            spec, arrays = wire.pack(wire.unpack(reply["arrays"], body))
            installed, _ = ask(call, target, {"op": "import", "routing": new.to_json(), "vshards": part, "arrays": spec},
                               *arrays, deadline_s=deadline_s)
            report.rows_moved += int(installed["rows"])
            report.pauses_s += [time.monotonic() - adopted] * len(part)
    release(call, everyone, deadline_s)
    report.seconds = time.monotonic() - started
    return report
