"""Dynamic data sharding: epochs of tasks (row ranges of shards) in todo / doing / done.

Every operation is O(1) in the number of tasks (deques, dicts and array indexing, no
list.pop(0)), and an epoch's tasks are implicit in the shard sizes: task i of an epoch is the i-th
piece of the shards cut into rows_per_task rows, so an epoch holds only its hand-out order (4
bytes a task) and which of its tasks are done (1 byte). A `Task` object exists only for a task in
flight, one given back or split, and a split task's pieces; a million-task job holds about 5
bytes a task. Epochs are opened when they become current (or one ahead). A task is consumed
minibatch by minibatch, in order, so the rows of a task that applied steps cover are always a
prefix of it: `task.applied` rows.
"""

from __future__ import annotations

import array
import bisect
import collections
from dataclasses import dataclass

import numpy as np

from elastic_step import defaults
from elastic_step.errors import JobFailed


# Finished tasks whose objects are kept a while: the ledger looks each up once more when it
# finalizes its step (one step later).
FINISHED_KEPT = 1024


@dataclass(slots=True)
class Task:
    id: int
    epoch: int
    shard: int  # index into the train split's shards
    start: int  # first row, within the shard
    count: int
    failures: int = 0
    applied: int = 0  # rows of it that applied steps consumed: a prefix

    def describe(self, shard_names: list[str]) -> str:
        return f"shard {shard_names[self.shard]} rows [{self.start}, {self.start + self.count}) of epoch {self.epoch}"


def cut_tasks(shard_rows: list[int], rows_per_task: int) -> list[tuple[int, int, int]]:
    """(shard, start, count) ranges: each shard cut into rows_per_task pieces, the last shorter."""
    return [
        (shard, start, min(rows_per_task, rows - start))
        for shard, rows in enumerate(shard_rows)
        for start in range(0, rows, rows_per_task)
    ]


class _Cut:
    """The pieces of every epoch, computed rather than stored: piece i's (shard, start, count)."""

    def __init__(self, shard_rows: list[int], rows_per_task: int):
        self.shard_rows = shard_rows
        self.rows_per_task = rows_per_task
        counts = [(rows + rows_per_task - 1) // rows_per_task for rows in shard_rows]
        self.ends = np.cumsum(counts, dtype=np.int64)  # pieces up to and including each shard
        self._ends = self.ends.tolist()  # the same for bisect: a Python list searches faster one at a time
        self.size = int(self.ends[-1]) if counts else 0
        # Shards of one size (prepare-data's, but the last) cut alike: a division finds the shard.
        self._per_shard = counts[0] if counts and all(c == counts[0] for c in counts[:-1]) else 0

    def piece(self, i: int) -> tuple[int, int, int]:
        if self._per_shard:
            shard = min(i // self._per_shard, len(self.shard_rows) - 1)
        else:
            shard = bisect.bisect_right(self._ends, i)
        start = (i - (self._ends[shard - 1] if shard else 0)) * self.rows_per_task
        return shard, start, min(self.rows_per_task, self.shard_rows[shard] - start)


class _Epoch:
    """One epoch: `order[handed:]` and `front` (given-back tasks, taken first) are its todo.
    An implicit epoch's task ids are `base + i` for piece i; a restored one has only explicit
    tasks (ids from the dispatcher's counter, `order` empty)."""

    def __init__(self, base: int, order: array.array, total_rows: int):
        self.base = base
        self.order = order
        self.handed = 0
        # Python arrays, not numpy's: one element read or written at a time is several times faster.
        self.done = bytearray(len(order))  # 1: an implicit task finished and its object let go
        self.front: collections.deque[Task] = collections.deque()
        self.doing: dict[int, Task] = {}
        self.total_rows = total_rows
        self.applied_rows = 0

    @property
    def has_todo(self) -> bool:
        return bool(self.front) or self.handed < len(self.order)

    @property
    def complete(self) -> bool:
        return self.applied_rows == self.total_rows


class _Tasks:
    """`dispatcher.tasks`: read access by id to every task of the epochs still kept (a task not
    in flight is built from the cut as a fresh object)."""

    def __init__(self, dispatcher: Dispatcher):
        self._dispatcher = dispatcher

    def get(self, task_id: int, default=None):
        task = self._dispatcher._find(task_id)
        return default if task is None else task

    def __getitem__(self, task_id: int) -> Task:
        task = self._dispatcher._find(task_id)
        if task is None:
            raise KeyError(task_id)
        return task

    def __contains__(self, task_id: int) -> bool:
        return self._dispatcher._find(task_id) is not None

    def __len__(self) -> int:
        d = self._dispatcher
        return sum(len(e.order) for e in d._epochs.values()) + sum(1 for t in d._objects if t >= d._implicit_ids)


class Dispatcher:
    def __init__(
        self,
        shard_rows: list[int],
        shard_names: list[str],
        rows_per_task: int,
        epochs: int,
        shuffle: bool = True,
        seed: int = 0,
        max_task_failures: int = defaults.MAX_TASK_FAILURES,
    ):
        if rows_per_task < 1:
            raise ValueError("rows_per_task must be at least 1")
        self.shard_names = shard_names
        self.epochs = epochs
        self.shuffle = shuffle
        self.seed = seed
        self.max_task_failures = max_task_failures
        self._cut = _Cut(list(shard_rows), rows_per_task)
        self.rows_per_epoch = sum(shard_rows)
        # Ids below this are implicit (epoch e's piece i is e * pieces + i); split pieces and
        # restored tasks take ids from _next_id upwards.
        self._implicit_ids = self._cut.size * max(epochs, 1)
        self._next_id = self._implicit_ids
        self._objects: dict[int, Task] = {}  # every Task object of the kept epochs (in flight, given back, split)
        self._finished: collections.deque[Task] = collections.deque()  # finished, object not yet let go
        self.tasks = _Tasks(self)
        self.holder: dict[int, str] = {}  # task id -> worker id, for tasks in doing
        self._epochs: dict[int, _Epoch] = {}
        self.current_epoch = 0
        if epochs > 0:
            self._open_epoch(0)

    # -- tasks by id -------------------------------------------------------------------------------
    def _find(self, task_id: int) -> Task | None:
        """The task's object, or a fresh one built from the cut for an implicit task not in flight."""
        task = self._objects.get(task_id)
        if task is not None or not 0 <= task_id < self._implicit_ids or not self._cut.size:
            return task
        epoch, index = divmod(task_id, self._cut.size)
        state = self._epochs.get(epoch)
        if state is None or index >= len(state.order):
            return None  # a forgotten epoch's, or a restored (explicit) epoch has no implicit tasks
        shard, start, count = self._cut.piece(index)
        return Task(task_id, epoch, shard, start, count, applied=count if state.done[index] else 0)

    def _object(self, task_id: int) -> Task:
        """The task as an object the dispatcher keeps (made from the cut if need be), or KeyError."""
        task = self._objects.get(task_id)
        if task is None:
            task = self.tasks[task_id]
            self._objects[task_id] = task
        return task

    def _finish(self, task: Task) -> None:
        """A task is finished: its object is let go later, once the ledger has finalized the steps
        that name it (those look it up; rebuilding it from the cut costs more than keeping it)."""
        self._finished.append(task)
        if len(self._finished) > FINISHED_KEPT:
            self._release(self._finished.popleft())

    def _release(self, task: Task) -> None:
        """A finished task's object goes where it is implicit and whole (not a split's prefix),
        unless a voided step has put it back in flight since."""
        epoch = self._epochs.get(task.epoch)
        if epoch is None or self._objects.get(task.id) is not task or task.applied != task.count or task.id in epoch.doing:
            return
        index = task.id - epoch.base
        whole_end = min(task.start + self._cut.rows_per_task, self._cut.shard_rows[task.shard])
        if task.id < self._implicit_ids and 0 <= index < len(epoch.order) and task.start + task.count == whole_end:
            epoch.done[index] = 1
            del self._objects[task.id]

    # -- epochs ---------------------------------------------------------------------------
    def _open_epoch(self, epoch: int) -> None:
        size = self._cut.size
        order = (np.random.default_rng(self.seed * 1_000_003 + epoch).permutation(size) if self.shuffle
                 else np.arange(size))
        code = "i" if size < 2**31 else "q"
        self._epochs[epoch] = _Epoch(epoch * size, array.array(code, order.astype(code).tobytes()), self.rows_per_epoch)

    def _new_task(self, epoch: int, shard: int, start: int, count: int, failures: int = 0) -> Task:
        task = Task(self._next_id, epoch, shard, start, count, failures)
        self._next_id += 1
        self._objects[task.id] = task
        return task

    def _advance(self) -> None:
        while self.current_epoch < self.epochs and self._epochs[self.current_epoch].complete:
            finished = self.current_epoch
            self.current_epoch += 1
            if self.current_epoch < self.epochs and self.current_epoch not in self._epochs:
                self._open_epoch(self.current_epoch)
            self._forget_epoch(finished)

    def _forget_epoch(self, epoch: int) -> None:
        # A completed epoch is kept for two more epochs: a voided (tentative) step can still
        # reopen it (see unapply), and with one epoch of look-ahead one step can complete two
        # epochs. Older ones are dropped so memory stays a few epochs.
        old = self._epochs.pop(epoch - 2, None)
        if old is not None:
            for task_id in [t for t, task in self._objects.items() if task.epoch == epoch - 2]:
                del self._objects[task_id]

    @property
    def finished(self) -> bool:
        return self.current_epoch >= self.epochs

    def epoch_progress(self) -> tuple[int, int]:
        """(rows applied, rows in all epochs) over the whole job."""
        if self.finished:
            total = self.rows_per_epoch * self.epochs
            return total, total
        current = self._epochs[self.current_epoch]
        return self.current_epoch * self.rows_per_epoch + current.applied_rows, self.rows_per_epoch * self.epochs

    # -- handing out and taking back --------------------------------------------------------
    def next_task(self, worker_id: str) -> Task | None:
        """The next task for a worker, or None: wait (the epoch's last tasks are in flight) or finished."""
        if self.finished:
            return None
        # While the current epoch's last tasks are in flight, the next epoch's tasks are handed
        # out already (one epoch ahead at most), so workers never idle at an epoch boundary.
        # Exactly-once is per epoch and each task names its epoch, so interleaving is safe.
        epoch = self._epochs[self.current_epoch]
        if not epoch.has_todo and self.current_epoch + 1 < self.epochs:
            if self.current_epoch + 1 not in self._epochs:
                self._open_epoch(self.current_epoch + 1)
            epoch = self._epochs[self.current_epoch + 1]
        if epoch.front:
            task = epoch.front.popleft()
        elif epoch.handed < len(epoch.order):
            task = self._object(epoch.base + epoch.order[epoch.handed])
            epoch.handed += 1
        else:
            return None
        epoch.doing[task.id] = task
        self.holder[task.id] = worker_id
        return task

    def return_task(self, task_id: int, failed: bool, reason: str = "") -> None:
        """Put a task's unapplied rows back in todo (front, so they are taken next)."""
        task = self.tasks[task_id]
        epoch = self._epochs[task.epoch]
        if task_id not in epoch.doing:
            return
        task = epoch.doing.pop(task_id)
        del self.holder[task_id]
        failures = task.failures + (1 if failed else 0)
        if failures >= self.max_task_failures:
            raise JobFailed(
                f"{task.describe(self.shard_names)} failed {failures} times"
                + (f" (last: {reason})" if reason else "")
                + "; check that shard and the model definition's feed()"
            )
        done = task.applied
        if done == 0:
            task.failures = failures
            epoch.front.appendleft(task)
            return
        # Split: the applied prefix stays behind as a finished task (ledger entries point at
        # it); the rest becomes a new task at the front of todo.
        remaining = task.count - done
        task.count = done
        epoch.front.appendleft(self._new_task(task.epoch, task.shard, task.start + done, remaining, failures))

    def return_all(self, failed_holders: set[str] = frozenset()) -> int:
        """Return every task in doing; tasks held by a failed worker count a failure. Returns how many."""
        returned = 0
        for epoch in list(self._epochs.values()):
            for task_id in list(epoch.doing):
                self.return_task(task_id, failed=self.holder[task_id] in failed_holders)
                returned += 1
        return returned

    # -- the ledger's view -------------------------------------------------------------------
    def check_step(self, ranges: list[tuple[int, int, int, str | None]]) -> None:
        """Validate one step's (task, offset, count, holder) ranges together, before any of them
        is applied, so a step is taken whole or not at all. Each rank consumes one task per step,
        so a task named twice is refused; a range must continue its task's applied prefix; and
        where the holder is given, the task must be one the master handed to that worker (a
        report cannot claim rows of a task another worker holds, or of one in nobody's hands)."""
        seen: set[int] = set()
        for task_id, offset, count, holder in ranges:
            if task_id in seen:
                raise ValueError(f"task {task_id} is named twice in one step; each rank consumes one task per step")
            seen.add(task_id)
            self.check_range(task_id, offset, count)
            if holder is not None and self.holder.get(task_id) != holder:
                held_by = self.holder.get(task_id) or "nobody"
                raise ValueError(f"task {task_id} is held by {held_by}, not by {holder} whose rank reported rows of it")

    def check_range(self, task_id: int, offset: int, count: int) -> Task:
        task = self._find(task_id)
        if task is None:
            raise ValueError(f"unknown task {task_id}")
        return self._continues(task, offset, count)

    @staticmethod
    def _continues(task: Task, offset: int, count: int) -> Task:
        if offset != task.applied or offset + count > task.count or count <= 0:
            raise ValueError(
                f"range [{offset}, {offset + count}) of task {task.id} does not continue its applied prefix "
                f"of {task.applied} of {task.count} rows"
            )
        return task

    def mark_applied(self, task_id: int, offset: int, count: int) -> Task:
        try:
            task = self._continues(self._object(task_id), offset, count)
        except KeyError:
            raise ValueError(f"unknown task {task_id}") from None
        task.applied += count
        epoch = self._epochs[task.epoch]
        epoch.applied_rows += count
        if task.applied == task.count and epoch.doing.pop(task_id, None) is not None:
            self.holder.pop(task_id, None)
            self._finish(task)
        self._advance()
        return task

    def unapply(self, task_id: int, count: int) -> None:
        """Undo the newest `count` applied rows of a task (a voided step)."""
        task = self._object(task_id)
        if task.epoch < self.current_epoch:
            self.current_epoch = task.epoch  # the voided step had completed that epoch
        epoch = self._epochs[task.epoch]
        epoch.applied_rows -= count
        task.applied -= count
        if task_id not in epoch.doing:
            epoch.doing[task_id] = task
            self.holder[task_id] = ""  # its holder applied nothing wrong; not a failure

    # -- checkpoints --------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """What a checkpoint stores of the ledger: per unfinished epoch, every task with the rows
        of it applied so far. Epochs before `current_epoch` are complete."""
        return {
            "current_epoch": self.current_epoch,
            "epochs": {str(e): self._epoch_rows(e, epoch) for e, epoch in self._epochs.items()
                       if e >= self.current_epoch and not epoch.complete},
        }

    def _epoch_rows(self, e: int, epoch: _Epoch) -> list[list[int]]:
        """[shard, start, count, applied] of every task of an epoch: its implicit pieces (from the
        cut, vectorised), each replaced by its object where one exists, then its other objects."""
        cut, n = self._cut, len(epoch.order)
        index = np.arange(n, dtype=np.int64)
        shard = np.searchsorted(cut.ends, index, side="right")
        first = np.concatenate([[0], cut.ends[:-1]])[shard] if n else index
        start = (index - first) * cut.rows_per_task
        count = np.minimum(cut.rows_per_task, np.asarray(cut.shard_rows, dtype=np.int64)[shard] - start) if n else index
        applied = np.where(np.frombuffer(bytes(epoch.done), dtype=np.bool_), count, 0)
        rows = [list(r) for r in zip(shard.tolist(), start.tolist(), count.tolist(), applied.tolist())]
        for task in self._objects.values():
            if task.epoch != e:
                continue
            entry = [task.shard, task.start, task.count, task.applied]
            if task.id < self._implicit_ids and 0 <= task.id - epoch.base < n:
                rows[task.id - epoch.base] = entry
            else:
                rows.append(entry)
        return rows

    def start_over(self) -> None:
        """Back to the job's start: no row applied, nothing in flight (a group restored before its
        first checkpoint). Task ids go on from where they were, so no old id names a new task."""
        self._objects, self.holder, self._epochs = {}, {}, {}
        self._finished.clear()
        self.current_epoch = 0
        if self.epochs > 0:
            self._open_epoch(0)

    def restore(self, snapshot: dict) -> None:
        """Continue from a checkpoint: applied rows stay applied, every other row is in todo."""
        self._objects, self.holder, self._epochs = {}, {}, {}
        self._finished.clear()
        self.current_epoch = int(snapshot["current_epoch"])
        for key, rows in snapshot["epochs"].items():
            epoch = int(key)
            state = _Epoch(0, array.array("i"), 0)  # explicit tasks only
            for shard, start, count, applied in rows:
                if applied:
                    finished = self._new_task(epoch, shard, start, applied)
                    finished.applied = applied
                    state.total_rows += applied
                    state.applied_rows += applied
                if applied < count:
                    state.front.append(self._new_task(epoch, shard, start + applied, count - applied))
                    state.total_rows += count - applied
            self._epochs[epoch] = state
        if not self.finished and self.current_epoch not in self._epochs:
            self._open_epoch(self.current_epoch)
