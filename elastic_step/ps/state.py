"""ShardState: what one shard holds and the rules it applies, apart from any network.

- A push is keyed by (table, task, batch_seq). A key already applied is acknowledged and not
  applied again, whatever its attempt: a re-sent push, or a re-issued task's batch that an
  earlier attempt already pushed, changes nothing.
- An accepted push is appended to the ledger and applied under the lock, then fsync'd outside
  it (ledger.py's group commit), then acknowledged. A re-sent push is acknowledged only once
  everything written before it is durable too, so its first copy's record is on disk. A pull
  may see an update whose fsync is still running; a crash then loses it, but its push was not
  acknowledged, so the worker sends it again.
- Every `snapshot_every` accepted pushes the whole state is written as a snapshot and the ledger
  starts empty. Recovery loads the snapshot and replays the ledger; the applied keys make that
  replay idempotent, so a crash between the snapshot's rename and the ledger's rotation, which
  leaves records the snapshot already holds, replays nothing twice.
- Requests name the routing epoch they were routed under; another epoch, or an id whose virtual
  shard this shard does not own, is refused for the client to re-route.
"""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np

from elastic_step.ps import snapshot
from elastic_step.ps.api import Status, TableSpec
from elastic_step.ps.applied import AppliedKeys
from elastic_step.ps.ledger import Ledger, LedgerRecord, _fsync_dir, replay
from elastic_step.ps.routing import RoutingTable
from elastic_step.ps.table import EmbeddingTable

SNAPSHOT_FILE = "snapshot.bin"
LEDGER_FILE = "ledger.bin"
ROUTING_FILE = "routing.json"


class ShardState:
    def __init__(self, directory: str, specs: list[TableSpec], shard: int, routing: RoutingTable, snapshot_every: int = 1000, sync: bool = True):
        self.directory = directory
        self.tables = {spec.name: EmbeddingTable(spec) for spec in specs}
        self.applied = {name: AppliedKeys() for name in self.tables}
        self.shard = shard
        self.routing = routing
        self.snapshot_every = snapshot_every
        self.sync = sync
        self.since_snapshot = 0
        self.lock = threading.Lock()
        self.ledger: Ledger | None = None
        self.recovery_s: dict[str, float] = {}  # how long the last recovery took, by phase

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def recover(self) -> int:
        """Load the snapshot, replay the ledger's tail; the number of pushes replayed."""
        saved = self._path(ROUTING_FILE)
        if os.path.exists(saved):
            with open(saved, encoding="utf-8") as f:
                newer = RoutingTable.from_json(json.load(f))
            if newer.epoch > self.routing.epoch:
                self.routing = newer
        started = time.perf_counter()
        tables, applied = snapshot.load(self._path(SNAPSHOT_FILE), list(self.tables))
        for name, parts in tables.items():
            self.tables[name].load(**parts)
            self.applied[name] = applied[name]
        loaded = time.perf_counter()
        replayed = 0
        for record in replay(self._path(LEDGER_FILE), lambda name: self.tables[name].spec.dim):
            replayed += self._apply(record)
        self.since_snapshot = replayed
        self.recovery_s = {"load_s": round(loaded - started, 3), "replay_s": round(time.perf_counter() - loaded, 3)}
        self.ledger = Ledger(self._path(LEDGER_FILE), sync=self.sync)
        return replayed

    def check(self, epoch: int, ids: np.ndarray | None = None) -> Status:
        if epoch != self.routing.epoch:
            return Status.STALE_EPOCH
        if ids is not None and len(ids) and not (self.routing.shard_of(ids) == self.shard).all():
            return Status.WRONG_SHARD
        return Status.OK

    def pull(self, table: str, ids: np.ndarray) -> np.ndarray:
        with self.lock:
            return self.tables[table].pull(ids)

    def push(self, record: LedgerRecord) -> bool:
        """Apply a push once; False when its (table, task, batch_seq) was applied before."""
        with self.lock:
            applied = (record.task, record.batch_seq) not in self.applied[record.table]
            if applied:
                mark = self.ledger.append(record)
                self._apply(record)
                self.since_snapshot += 1
                if self.since_snapshot >= self.snapshot_every:
                    self._snapshot()
            else:
                mark = self.ledger.written
        self.ledger.sync_through(mark)  # durable before it is acknowledged
        return applied

    def _apply(self, record: LedgerRecord) -> int:
        key = (record.task, record.batch_seq)
        if key in self.applied[record.table]:
            return 0
        self.tables[record.table].push(record.ids, record.grads)
        self.applied[record.table].add(key)
        return 1

    def snapshot(self) -> None:
        with self.lock:
            self._snapshot()

    def _snapshot(self) -> None:
        snapshot.save(self._path(SNAPSHOT_FILE), {n: t.arrays() for n, t in self.tables.items()}, self.applied)
        self.ledger.rotate()
        self.since_snapshot = 0

    def set_routing(self, routing: RoutingTable) -> None:
        """Adopt a newer routing (an older or equal epoch is ignored), durably."""
        with self.lock:
            if routing.epoch <= self.routing.epoch:
                return
            partial = self._path(ROUTING_FILE + ".partial")
            with open(partial, "w", encoding="utf-8") as f:
                json.dump(routing.to_json(), f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, self._path(ROUTING_FILE))
            _fsync_dir(self._path(ROUTING_FILE))
            self.routing = routing

    def stats(self) -> dict:
        with self.lock:
            return {
                "epoch": self.routing.epoch,
                "tables": {n: {"rows": t.size, "bytes": t.nbytes, "pushes": len(self.applied[n])} for n, t in self.tables.items()},
            }

    def close(self) -> None:
        if self.ledger is not None:
            self.ledger.close()
