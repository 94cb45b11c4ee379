"""Dynamic data sharding: epochs of tasks (row ranges of shards) in todo / doing / done.

Every operation is O(1) in the number of tasks (deques and dicts, no list.pop(0)). Tasks of an
epoch are created when that epoch becomes current, so a million-task job holds one epoch of
tasks at a time. A task is consumed minibatch by minibatch, in order, so the rows of a task that
applied steps cover are always a prefix of it: `task.applied` rows.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np

from elastic_step import defaults
from elastic_step.errors import JobFailed


@dataclass(slots=True)  # a million tasks must fit in a few hundred MB
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


class _Epoch:
    def __init__(self, tasks: list[Task]):
        self.todo: collections.deque[Task] = collections.deque(tasks)
        self.doing: dict[int, Task] = {}
        self.total_rows = sum(t.count for t in tasks)
        self.applied_rows = 0

    @property
    def complete(self) -> bool:
        return self.applied_rows == self.total_rows


def cut_tasks(shard_rows: list[int], rows_per_task: int) -> list[tuple[int, int, int]]:
    """(shard, start, count) ranges: each shard cut into rows_per_task pieces, the last shorter."""
    return [
        (shard, start, min(rows_per_task, rows - start))
        for shard, rows in enumerate(shard_rows)
        for start in range(0, rows, rows_per_task)
    ]


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
        self._shard_rows = shard_rows
        self._rows_per_task = rows_per_task
        self.rows_per_epoch = sum(shard_rows)
        self.tasks: dict[int, Task] = {}  # every task not yet fully applied, plus done ones of open epochs
        self.holder: dict[int, str] = {}  # task id -> worker id, for tasks in doing
        self._epochs: dict[int, _Epoch] = {}
        self._next_id = 0
        self.current_epoch = 0
        if epochs > 0:
            self._open_epoch(0)

    # -- epochs ---------------------------------------------------------------------------
    def _open_epoch(self, epoch: int) -> None:
        # Ranges as numpy columns, not a list of tuples: a million-task epoch stays small.
        counts = [(rows + self._rows_per_task - 1) // self._rows_per_task for rows in self._shard_rows]
        shard = np.repeat(np.arange(len(counts)), counts)
        first = np.concatenate([[0], np.cumsum(counts)[:-1]]) if counts else np.zeros(0, dtype=np.int64)
        start = (np.arange(len(shard)) - np.repeat(first, counts)) * self._rows_per_task
        count = np.minimum(self._rows_per_task, np.asarray(self._shard_rows)[shard] - start)
        order = np.arange(len(shard))
        if self.shuffle:
            order = np.random.default_rng(self.seed * 1_000_003 + epoch).permutation(len(shard))
        tasks = [self._new_task(epoch, int(shard[i]), int(start[i]), int(count[i])) for i in order.tolist()]
        self._epochs[epoch] = _Epoch(tasks)

    def _new_task(self, epoch: int, shard: int, start: int, count: int, failures: int = 0) -> Task:
        task = Task(self._next_id, epoch, shard, start, count, failures)
        self._next_id += 1
        self.tasks[task.id] = task
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
            for task_id in [t for t, task in self.tasks.items() if task.epoch == epoch - 2]:
                del self.tasks[task_id]

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
        if not epoch.todo and self.current_epoch + 1 < self.epochs:
            if self.current_epoch + 1 not in self._epochs:
                self._open_epoch(self.current_epoch + 1)
            epoch = self._epochs[self.current_epoch + 1]
        if not epoch.todo:
            return None
        task = epoch.todo.popleft()
        epoch.doing[task.id] = task
        self.holder[task.id] = worker_id
        return task

    def return_task(self, task_id: int, failed: bool, reason: str = "") -> None:
        """Put a task's unapplied rows back in todo (front, so they are taken next)."""
        task = self.tasks[task_id]
        epoch = self._epochs[task.epoch]
        if task_id not in epoch.doing:
            return
        del epoch.doing[task_id]
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
            epoch.todo.appendleft(task)
            return
        # Split: the applied prefix stays behind as a finished task (ledger entries point at
        # it); the rest becomes a new task at the front of todo.
        remaining = task.count - done
        task.count = done
        epoch.todo.appendleft(self._new_task(task.epoch, task.shard, task.start + done, remaining, failures))

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
        task = self.tasks.get(task_id)
        if task is None:
            raise ValueError(f"unknown task {task_id}")
        if offset != task.applied or offset + count > task.count or count <= 0:
            raise ValueError(
                f"range [{offset}, {offset + count}) of task {task_id} does not continue its applied prefix "
                f"of {task.applied} of {task.count} rows"
            )
        return task

    def mark_applied(self, task_id: int, offset: int, count: int) -> Task:
        task = self.check_range(task_id, offset, count)
        task.applied += count
        epoch = self._epochs[task.epoch]
        epoch.applied_rows += count
        if task.applied == task.count:
            epoch.doing.pop(task_id, None)
            self.holder.pop(task_id, None)
        self._advance()
        return task

    def unapply(self, task_id: int, count: int) -> None:
        """Undo the newest `count` applied rows of a task (a voided step)."""
        task = self.tasks[task_id]
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
            "epochs": {
                str(e): [[t.shard, t.start, t.count, t.applied] for t in self.tasks.values() if t.epoch == e]
                for e, epoch in self._epochs.items()
                if e >= self.current_epoch and not epoch.complete
            },
        }

    def restore(self, snapshot: dict) -> None:
        """Continue from a checkpoint: applied rows stay applied, every other row is in todo."""
        self.tasks, self.holder, self._epochs = {}, {}, {}
        self.current_epoch = int(snapshot["current_epoch"])
        for key, rows in snapshot["epochs"].items():
            epoch, todo, done = int(key), [], []
            for shard, start, count, applied in rows:
                if applied:
                    finished = self._new_task(epoch, shard, start, applied)
                    finished.applied = applied
                    done.append(finished)
                if applied < count:
                    todo.append(self._new_task(epoch, shard, start + applied, count - applied))
            state = _Epoch(todo)
            state.total_rows += sum(t.count for t in done)
            state.applied_rows = sum(t.count for t in done)
            self._epochs[epoch] = state
        if not self.finished and self.current_epoch not in self._epochs:
            self._open_epoch(self.current_epoch)
