"""ShardState: what one shard holds and the rules it applies, apart from any network.

- A push is keyed by (table, task, batch_seq). A key already applied is acknowledged and not
  applied again, whatever its attempt: a re-sent push, or a re-issued task's batch that an
  earlier attempt already pushed, changes nothing.
- An accepted push is appended to the ledger and applied under the lock, its fsync running
  meanwhile on the ledger's thread (ledger.py's group commit), and acknowledged once the fsync
  is done too. A re-sent push is acknowledged only once everything written before it is
  durable too, so its first copy's record is on disk. A pull may see an update whose fsync is
  still running; a crash then loses it, but its push was not acknowledged, so the worker sends
  it again.
- Every `snapshot_every` accepted pushes the whole state is written as a snapshot and the ledger
  starts empty. Recovery loads the snapshot and replays the ledger; the applied keys make that
  replay idempotent, so a crash between the snapshot's rename and the ledger's rotation, which
  leaves records the snapshot already holds, replays nothing twice.
- Requests name the routing epoch they were routed under; another epoch, or an id whose virtual
  shard this shard does not own, is refused for the client to re-route.
- Moving virtual shards (`scale --ps`, moves.py): `adopt` takes the next routing and marks the
  virtual shards it gains *pending* (refused as MOVING until they arrive); `export` hands over
  the rows and applied keys of virtual shards it gives (from memory, under the lock: every
  update it accepted is in them, fsync'd or not, as the snapshot plus the ledger's tail would
  hold it); `install` takes them in, snapshots, and only then clears them from pending (a crash
  in between leaves them pending, and the install is sent again); `release` forgets the rows it
  gave and snapshots. Pending virtual shards are kept in routing.json beside the routing.
- Checkpoint cuts (cuts.py): a push names the step it is trained in; before applying the first
  push of a step past a multiple of `checkpoint_every`, the shard writes its cut of that
  multiple, and `cut(S)` hands the master the cut of a checkpoint of step S: that one, or the
  snapshot plus the ledger's records up to the first push of a step after S. For that, a
  snapshot due after `snapshot_every` pushes waits for the first push of the next step.
- A rollback (master/ps_rollback.py: another shard lost its rows) puts the shard back to its cut
  of a checkpoint behind a fence: pushes of rounds up to the fence (a push's `attempt` is its
  round) are refused from then on, across restarts too (fence.json), as their rounds trained on
  what went back.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time

import numpy as np

from elastic_step.ps import cuts, snapshot
from elastic_step.ps.api import Status, TableSpec
from elastic_step.ps.applied import AppliedGroups
from elastic_step.ps.ledger import Ledger, LedgerFailed, LedgerRecord, _fsync_dir, replay
from elastic_step.ps.routing import RoutingTable, virtual_shard_of
from elastic_step.ps.sizing import reserved_rows
from elastic_step.ps.table import EmbeddingTable

log = logging.getLogger("elastic_step.ps")

SNAPSHOT_FILE = "snapshot.bin"
LEDGER_FILE = "ledger.bin"
ROUTING_FILE = "routing.json"
FENCE_FILE = "fence.json"  # the newest rollback's fence: pushes of rounds up to it are refused
# Left by a shard stopping on a failed ledger fsync. Linux may keep the pages it could not write
# in its cache, marked clean, and the relaunch (same kernel) replays them from there: it then
# writes a snapshot, so that what it serves is on disk.
LEDGER_FAILED_FILE = "ledger_failed"


def write_fence(directory: str, fence: int) -> None:
    """Durably: refuse the pushes of rounds <= `fence` from now on, across restarts too."""
    partial = os.path.join(directory, FENCE_FILE + ".partial")
    with open(partial, "w", encoding="utf-8") as f:
        json.dump({"fence": int(fence)}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, os.path.join(directory, FENCE_FILE))
    _fsync_dir(os.path.join(directory, FENCE_FILE))


def read_fence(directory: str) -> int:
    try:
        with open(os.path.join(directory, FENCE_FILE), encoding="utf-8") as f:
            return int(json.load(f)["fence"])
    except FileNotFoundError:
        return 0


class Refused(Exception):
    """A request that no longer fits the shard's routing (its status says why)."""

    def __init__(self, status: Status):
        super().__init__(status.value)
        self.status = status


class ShardClosed(Exception):
    """The shard is stopping (SIGTERM: its pod deleted or evicted) and its state is closed: the
    request gets no answer, its connection is dropped, and the client asks again elsewhere or later
    (a reply saying "bad request" would fail the job)."""


class ShardState:
    def __init__(self, directory: str, specs: list[TableSpec], shard: int, routing: RoutingTable, snapshot_every: int = 1000, sync: bool = True,
                 checkpoint_every: int = 0):
        self.directory = directory
        owned = float((routing.owners == shard).mean())  # of the virtual shards: a declared table's share is reserved
        self.tables = {spec.name: EmbeddingTable(spec, reserved_rows(spec, owned)) for spec in specs}
        self.shard = shard
        self.routing = routing
        self.virtual_shards = len(routing.owners)
        self.applied = {name: AppliedGroups(self.virtual_shards) for name in self.tables}
        self.pending: set[int] = set()  # virtual shards this shard owns whose rows have not arrived
        self.previous: RoutingTable | None = None  # the routing the last move started from (resuming one)
        self.snapshot_every = snapshot_every
        self.sync = sync
        self.since_snapshot = 0
        self.lock = threading.Lock()
        self.ledger: Ledger | None = None
        self.recovery_s: dict[str, float] = {}  # how long the last recovery took, by phase
        self.checkpoint_every = checkpoint_every  # the job's --checkpoint-steps: cut at each multiple
        self.cut_step = 0  # the newest step this folder holds a cut of
        self.high: int | None = 0  # the newest step of a push applied; None: unknown (recovered state)
        self.snapshot_high: int | None = 0  # the newest step the snapshot holds a push of; None: unknown
        self.steps_begun: list[tuple[int, int]] = []  # (step, ledger offset of its first push) since the snapshot
        self.ledger_origin = 0  # ledger.written where the ledger file began
        self.closed = False  # set by close(): nothing is applied after it
        self.fence = 0  # pushes of rounds (their `attempt`) up to this are refused: the job rolled back past them (0: none)

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def recover(self) -> int:
        """Load the snapshot, replay the ledger's tail; the number of pushes replayed."""
        redone = cuts.finish_restore(self.directory, SNAPSHOT_FILE, LEDGER_FILE, ROUTING_FILE)
        if redone is not None:
            log.warning("shard %d: finished the restore of its cut of step %d that a crash interrupted", self.shard, redone)
        saved = self._path(ROUTING_FILE)
        if os.path.exists(saved):
            with open(saved, encoding="utf-8") as f:
                data = json.load(f)
            newer = RoutingTable.from_json(data)
            if newer.epoch > self.routing.epoch:
                self.routing, self.pending = newer, set(data.get("pending", []))
                self.previous = RoutingTable.from_json(data["previous"]) if data.get("previous") else None
        started = time.perf_counter()
        # Mapped, then copied into each table's own (reserved) arrays: the snapshot's rows are not
        # held in memory beside them, so a relaunch needs no more memory than the shard had.
        tables, applied = snapshot.load(self._path(SNAPSHOT_FILE), list(self.tables), self.virtual_shards, mapped=True)
        for name, parts in tables.items():
            self.tables[name].load(**parts)
            self.applied[name] = applied[name]
        loaded = time.perf_counter()
        replayed = self._replay()
        self.since_snapshot = replayed
        self.cut_step = max(cuts.steps(self.directory), default=0)
        if tables or replayed:  # pushes applied before this process: of which steps is not kept
            self.high = self.snapshot_high = None
        self.recovery_s = {"load_s": round(loaded - started, 3), "replay_s": round(time.perf_counter() - loaded, 3)}
        self.ledger = Ledger(self._path(LEDGER_FILE), sync=self.sync)
        self.ledger_origin = -os.path.getsize(self._path(LEDGER_FILE))
        self.fence = read_fence(self.directory)
        if os.path.exists(self._path(LEDGER_FAILED_FILE)):
            log.warning("shard %d: the last process stopped on a failed ledger fsync; writing a snapshot of what it "
                        "replayed so that it is on disk", self.shard)
            self._snapshot()
            os.remove(self._path(LEDGER_FAILED_FILE))
            _fsync_dir(self._path(LEDGER_FAILED_FILE))
        return replayed

    def note_failed_ledger(self) -> None:
        """Before the process stops on a failed ledger fsync: tell its relaunch (LEDGER_FAILED_FILE).
        Best effort, as the disk may refuse this too."""
        with contextlib.suppress(OSError):
            # Not write_atomic: it deletes a file it could not fsync, and a relaunch on this node
            # sees the file in the kernel's cache, synced or not (that is the case it is for).
            with open(self._path(LEDGER_FAILED_FILE), "w", encoding="utf-8") as f:
                f.write("the ledger's fsync failed; the relaunch writes a snapshot\n")
                f.flush()
                with contextlib.suppress(OSError):
                    os.fsync(f.fileno())

    def _replay(self) -> int:
        """Apply the ledger's tail; the pushes applied. A record these tables cannot take (a job
        resumed with another model definition: a table it no longer has, or a smaller rows=) is
        refused in one line naming it, not with an index error."""
        path, replayed = self._path(LEDGER_FILE), 0

        def dim_of(name: str) -> int:
            if name not in self.tables:
                raise ValueError(f"pushes to table {name!r}, which this job does not declare (it declares "
                                 f"{', '.join(map(repr, self.tables))}): resume with the model definition that trained it")
            return self.tables[name].spec.dim

        try:
            for record in replay(path, dim_of):
                table = self.tables[record.table]
                if table.outside(record.ids) is not None:
                    raise ValueError(f"pushes to table {record.table!r} with ids outside its declared {table.spec.rows:,} "
                                     "rows: declare the rows= it was trained with")
                replayed += self._apply(record)
        except ValueError as exc:
            raise ValueError(f"{path} holds {exc}") from None
        return replayed

    def check(self, epoch: int, ids: np.ndarray | None = None) -> Status:
        if epoch != self.routing.epoch:
            return Status.STALE_EPOCH
        if ids is not None and len(ids):
            vshards = virtual_shard_of(ids, self.virtual_shards)
            if not (self.routing.owners[vshards] == self.shard).all():
                return Status.WRONG_SHARD
            if self.pending and np.isin(vshards, list(self.pending)).any():
                return Status.MOVING
        return Status.OK

    def _checked(self, epoch: int | None, ids: np.ndarray) -> None:
        """Under the lock: a request routed under `epoch` still fits (a move may have begun since
        the handler's first check, and a row updated after its export would be lost)."""
        if epoch is not None and (status := self.check(epoch, ids)) is not Status.OK:
            raise Refused(status)

    def pull(self, table: str, ids: np.ndarray, epoch: int | None = None) -> np.ndarray:
        with self.lock:
            self._checked(epoch, ids)
            return self.tables[table].pull(ids)

    def push(self, record: LedgerRecord, epoch: int | None = None, step: int | None = None) -> bool:
        """Apply a push once; False when its (table, task, batch_seq) was applied before.
        Refused when `epoch` (that of the request, if any) no longer fits its ids. `step`: the
        training step it belongs to (a checkpoint's cut may be due before it)."""
        applied, mark = self.accept(record, epoch, step)
        self.ledger.sync_through(mark)  # durable before it is acknowledged
        return applied

    def accept(self, record: LedgerRecord, epoch: int | None = None, step: int | None = None) -> tuple[bool, int]:
        """`push` but for its fsync: (applied, the ledger mark that must be durable before the
        push is acknowledged: ledger.sync_through). For a caller that makes several shards'
        records durable at once, as shard processes do side by side (benchmarks/bench_sparse.py).
        The fsync starts before the push is applied, so that it overlaps the apply."""
        with self.lock:
            if self.closed:
                raise ShardClosed("the shard is stopping")
            if self.fence and record.attempt <= self.fence:  # its round trained on what the job rolled back
                raise Refused(Status.FENCED)
            self._checked(epoch, record.ids)
            applied = self.applied[record.table].missing((record.task, record.batch_seq))
            if applied and step is not None:
                self._begin(step)
            if applied:
                mark = self.ledger.append(record)
                self.ledger.start_sync(mark)
                applied = self._apply(record) > 0  # False when only groups without its rows lacked the key
                self.since_snapshot += 1
                if self.since_snapshot >= self.snapshot_every and step is None:
                    self._snapshot()
            else:
                mark = self.ledger.written
        return applied, mark

    def _apply(self, record: LedgerRecord) -> int:
        key, groups = (record.task, record.batch_seq), self.applied[record.table]
        if not groups.missing(key):
            return 0
        vshards = virtual_shard_of(record.ids, self.virtual_shards) if groups.extra else np.zeros(len(record.ids), np.int64)
        fresh = groups.take(key, vshards, self.owned)  # one group (no move yet): no need to hash
        if fresh.all():
            self.tables[record.table].push(record.ids, record.grads)
        elif fresh.any():  # a part whose moved-in rows had not got this key yet (moves.py)
            self.tables[record.table].push(record.ids[fresh], record.grads[fresh])
        return int(fresh.any() or not len(fresh))

    def snapshot(self) -> None:
        with self.lock:
            self._snapshot()

    # -- checkpoint cuts (cuts.py) -------------------------------------------------------------
    CROSSED_LINKS = 16  # multiples of K crossed at once that get a cut (the master asks for the newest)

    def _begin(self, step: int) -> None:
        """Before a push of `step` is applied: at the first push of a new step, the cut a
        multiple of K needs, a snapshot that is due, and where the step begins in the ledger."""
        self._cut_before(step)
        if self.high is not None and step <= self.high:
            return
        if self.snapshot_high is None:
            # Relaunched: the replayed ledger does not say where its steps begin. A snapshot now
            # holds no push of a step after this one (none was sent yet), so later steps can be cut.
            self.high = step
            self._snapshot()
        elif self.since_snapshot >= self.snapshot_every:
            self._snapshot()  # between steps, so that any step since can still be cut
        self.steps_begun.append((step, self.ledger.written - self.ledger_origin))
        self.high = step

    def _cut_before(self, step: int) -> None:
        """Before a push of `step`: the cut of the last multiple of K below it, unless there is
        one. Cheap (links and the ledger's tail; hashed when the master asks), as it holds pushes."""
        every = self.checkpoint_every
        crossed = every * ((step - 1) // every) if every else 0
        if crossed <= self.cut_step:
            return
        skipped = list(range((self.cut_step // every + 1) * every, crossed, every)[-self.CROSSED_LINKS:])
        if self.high is None or self.snapshot_high is None:
            # Relaunched since the snapshot, where steps begin in the ledger is not known; no cut
            # of `crossed` means no push after it was applied, so the tables now are its cut.
            self._write_cut(crossed, skipped)
            return
        try:
            self._ledger_cut(crossed, self._ledger_through(crossed), skipped, hashed=False)
        except cuts.CutMissing as exc:  # never expected; the push goes on, the master's ask will fail
            log.warning("no cut of step %d: %s", crossed, exc)

    def _write_cut(self, step: int, also: list[int] = ()) -> dict:
        os.makedirs(cuts.folder(self.directory), exist_ok=True)
        cuts.discard(self.directory, [step, *also])
        for groups in self.applied.values():
            groups.compact(self.owned)
        snapshot.save(cuts.path(self.directory, step), {n: t.arrays() for n, t in self.tables.items()}, self.applied)
        self.cut_step = max(self.cut_step, step)
        return cuts.seal(self.directory, step, self.routing.to_json(), also, hashed=False)

    def cut(self, step: int, keep: list[int] = ()) -> dict:
        """The cut of a checkpoint of `step` (cuts.py's meta: step, routing, digest): the one
        written at the first push after it, else the snapshot with the ledger's records of steps
        <= `step`. Cuts a resume can no longer load (cuts.retain: `keep`, the committed) are dropped.
        CutMissing when neither can be had (a snapshot or a relaunch since `step`)."""
        with self.lock:
            found = cuts.meta(self.directory, step)
            if found is None:
                found = self._ledger_cut(step, self._ledger_through(step))
            elif found["digest"] is None:  # written at a step's first push: hashed only now
                found = cuts.seal(self.directory, step, found["routing"])
            cuts.retain(self.directory, [int(k) for k in keep])
            return found

    def _ledger_through(self, step: int) -> int:
        """How many bytes of the ledger hold the pushes of steps <= `step` after the snapshot."""
        if self.high is None or self.snapshot_high is None:
            raise cuts.CutMissing(f"shard {self.shard} was relaunched since its last snapshot and holds no cut of step {step}")
        if self.snapshot_high > step:
            raise cuts.CutMissing(f"shard {self.shard} took a snapshot after step {step} (one every {self.snapshot_every} "
                                  f"pushes) and holds no cut of it")
        later = [offset for begun, offset in self.steps_begun if begun > step]
        return later[0] if later else self.ledger.written - self.ledger_origin

    def _ledger_cut(self, step: int, length: int, also: list[int] = (), hashed: bool = True) -> dict:
        """cuts/STEP: the snapshot (a hard link: it is replaced, never rewritten) and a copy of
        the ledger's first `length` bytes; the steps in `also` get the same files."""
        os.makedirs(cuts.folder(self.directory), exist_ok=True)
        target = cuts.path(self.directory, step)
        cuts.discard(self.directory, [step, *also])
        if os.path.exists(self._path(SNAPSHOT_FILE)):
            os.link(self._path(SNAPSHOT_FILE), target)
        else:  # none yet: the tables were empty
            snapshot.save(target, {}, {})
        cuts.copy_prefix(self._path(LEDGER_FILE), cuts.path(self.directory, step, "ledger"), length)
        self.cut_step = max(self.cut_step, step)
        return cuts.seal(self.directory, step, self.routing.to_json(), also, hashed)

    def rollback(self, step: int, digest: str, fence: int) -> int:
        """The job goes back to its checkpoint of `step` (a deleted shard pod's rows are gone
        with it): refuse the pushes of rounds <= `fence` from now on, then hold exactly this
        folder's cut of `step` again, as a shard relaunched from it would (master/ps_rollback.py).
        CutMissing when that cut is not here, not the recorded one, or of another routing, and
        then nothing changed. The pushes replayed from the cut's ledger."""
        with self.lock:
            found = cuts.verified(self.directory, step, digest)  # before anything changes
            if list(found["routing"]["owners"]) != self.routing.owners.tolist():
                raise cuts.CutMissing(f"shard {self.shard}'s cut of step {step} is of another routing (a scale --ps since)")
            write_fence(self.directory, fence)
            self.fence = fence
            routing = self.routing
            self.ledger.close()  # what it held is void: a push applied before waits on no fsync of it
            try:
                cuts.restore(self.directory, step, digest, SNAPSHOT_FILE, LEDGER_FILE, ROUTING_FILE)
            except OSError as exc:  # the ledger is closed and the folder half restored: the shard must stop
                self.ledger.failed = exc
                raise LedgerFailed(f"{self.directory}: putting back the cut of step {step} failed ({exc}); "
                                   "the relaunched shard finishes it") from exc
            self.tables = {name: EmbeddingTable(table.spec, table.reserved) for name, table in self.tables.items()}
            self.applied = {name: AppliedGroups(self.virtual_shards) for name in self.tables}
            self.pending, self.previous, self.steps_begun = set(), None, []
            self.high = self.snapshot_high = 0
            replayed = self.recover()
            self._save_routing(routing, set())  # the cut's copy may be of older endpoints
            return replayed

    @property
    def owned(self) -> np.ndarray:
        return self.routing.owners == self.shard

    def _snapshot(self, owned: np.ndarray | None = None) -> None:
        for groups in self.applied.values():
            groups.compact(self.owned if owned is None else owned)
        snapshot.save(self._path(SNAPSHOT_FILE), {n: t.arrays() for n, t in self.tables.items()}, self.applied)
        self.ledger.rotate()
        self.since_snapshot = 0
        self.snapshot_high, self.steps_begun, self.ledger_origin = self.high, [], self.ledger.written

    def set_routing(self, routing: RoutingTable) -> None:
        """Adopt a newer routing (an older or equal epoch is ignored), durably, as it is: the
        rows of virtual shards it gains are created afresh (`adopt` waits for them instead)."""
        with self.lock:
            if routing.epoch > self.routing.epoch:
                self._save_routing(routing, self.pending)

    def _save_routing(self, routing: RoutingTable, pending: set[int]) -> None:
        partial = self._path(ROUTING_FILE + ".partial")
        with open(partial, "w", encoding="utf-8") as f:
            json.dump({**routing.to_json(), "pending": sorted(pending), "previous": self.previous and self.previous.to_json()}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, self._path(ROUTING_FILE))
        _fsync_dir(self._path(ROUTING_FILE))
        self.routing, self.pending = routing, set(pending)

    def adopt(self, routing: RoutingTable) -> None:
        """Take a newer routing whose new virtual shards are moved in: they stay pending (refused
        as MOVING) until `install` brings their rows and keys."""
        with self.lock:
            self._adopt(routing)

    def _adopt(self, routing: RoutingTable) -> None:
        """The flush: the virtual shards given away keep the keys they have now (frozen), in a
        snapshot made before the routing is, so that a replay after a crash cannot mark them."""
        if routing.epoch > self.routing.epoch:
            lost = self.owned & (routing.owners != self.shard)
            if lost.any():
                for groups in self.applied.values():
                    groups.split(lost)
                self._snapshot(routing.owners == self.shard)
            gained = set(routing.owned_by(self.shard).tolist()) - set(self.routing.owned_by(self.shard).tolist())
            self.previous = self.routing
            self._save_routing(routing, self.pending | gained)

    def _held_in(self, table: EmbeddingTable, vshards) -> np.ndarray:
        return np.isin(virtual_shard_of(table.ids[: table.size], self.virtual_shards), list(vshards))

    def export(self, vshards: list[int]) -> dict[str, np.ndarray]:
        """Copies of the rows and applied keys of `vshards` (moving away), named as a snapshot's."""
        arrays = {}
        with self.lock:
            for name, table in self.tables.items():
                arrays.update({f"{name}.{k}": v for k, v in table.where(self._held_in(table, vshards)).items()})
                groups = AppliedGroups(self.virtual_shards, extra=self.applied[name].export(np.asarray(vshards, np.int64)))
                arrays.update({f"{name}.applied_{k}": v for k, v in groups.to_arrays().items()})
        return arrays

    def install(self, routing: RoutingTable, vshards: list[int], arrays: dict[str, np.ndarray]) -> int:
        """Take in moved virtual shards (`export`'s arrays), once: only those still pending.
        The rows installed (0 when they had all arrived already)."""
        with self.lock:
            self._adopt(routing)
            arriving = self.pending & set(vshards)
            if not arriving:
                return 0
            installed = 0
            for name, table in self.tables.items():
                table.drop(self._held_in(table, arriving))  # a repeated install replaces its first copy
                rows = {k: arrays[f"{name}.{k}"] for k in ("ids", "rows", "updates")}
                mine = np.isin(virtual_shard_of(rows["ids"], self.virtual_shards), list(arriving))
                table.put(*(rows[k][mine] for k in ("ids", "rows", "updates")))
                installed += int(mine.sum())
                prefix = f"{name}.applied_"
                moved = AppliedGroups.from_arrays(self.virtual_shards, {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)})
                keep = np.isin(np.arange(self.virtual_shards), list(arriving))
                self.applied[name].install([(mask & keep, keys) for mask, keys in moved.extra if (mask & keep).any()])
            self._snapshot()  # the rows are durable before anyone may update them
            self._save_routing(self.routing, self.pending - arriving)
            return installed

    def release(self) -> int:
        """Forget the rows of virtual shards owned elsewhere now (moved away), durably; how many."""
        with self.lock:
            dropped = 0
            theirs = self.routing.owners != self.shard
            for name, table in self.tables.items():
                gone = theirs[virtual_shard_of(table.ids[: table.size], self.virtual_shards)]
                dropped += int(gone.sum())
                table.drop(gone)
                self.applied[name].forget(theirs)
            self._snapshot()
            return dropped

    def stats(self) -> dict:
        with self.lock:
            return {
                "epoch": self.routing.epoch,
                "pending": len(self.pending),
                "tables": {n: {"rows": t.size, "bytes": t.nbytes, "pushes": len(self.applied[n])} for n, t in self.tables.items()},
            }

    def close(self) -> None:
        """Under the lock, so that no push is between its checks and its ledger write. What the
        ledger holds is synced first: a push accepted after the last snapshot (SIGTERM's) waits
        for its fsync, and would find the file closed."""
        with self.lock:
            self.closed = True
            if self.ledger is not None:
                try:
                    if self.ledger.failed is None:  # else every waiter raises LedgerFailed itself
                        self.ledger.sync_through(self.ledger.written)
                finally:
                    self.ledger.close()
