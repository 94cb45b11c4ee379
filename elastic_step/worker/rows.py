"""The rows a rank trains on: pieces of its tasks, and how a step's rows are shared out.

A rank consumes its tasks in order, each from its first row, so the rows of a task that it has
trained on are always a prefix. With a fixed global batch a rank may finish one task and start
the next within a step, so its part of a step can be several pieces (ranges of tasks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from elastic_step.protocol import RangeRecord, TaskInfo, TaskStatus


@dataclass
class Piece:
    """Rows [offset, offset + count) of one task, with their features and labels."""

    task_id: int
    offset: int
    count: int
    features: object
    labels: object


class TaskRows:
    """The current task's rows not yet trained on, then the next tasks'. `take_task` blocks until
    the master answers (a task, or WAIT / REGROUP / DONE with no task)."""

    def __init__(self, take_task: Callable[[], tuple[TaskStatus, TaskInfo | None, tuple | None]]):
        self._take_task = take_task
        self._task: TaskInfo | None = None
        self._rows: tuple | None = None  # (features, labels) of the current task
        self._offset = 0
        self.status = TaskStatus.TASK  # the master's last answer

    def take(self, wanted: int, max_pieces: int) -> list[Piece]:
        """Up to `wanted` rows in at most `max_pieces` pieces. Fewer when the master has no task
        to give now (`status` then says why) or the pieces ran out."""
        pieces: list[Piece] = []
        while wanted > 0 and len(pieces) < max_pieces:
            if self._task is None or self._offset >= self._task.count:
                self.status, self._task, self._rows = self._take_task()
                self._offset = 0
                if self._task is None:
                    break
            count = min(wanted, self._task.count - self._offset)
            end = self._offset + count
            pieces.append(Piece(self._task.id, self._offset, count,
                                self._rows[0][self._offset:end], self._rows[1][self._offset:end]))
            self._offset, wanted = end, wanted - count
        return pieces

    @property
    def ran_out(self) -> bool:
        """The master had no task for this rank at its last ask (so it holds no rows now)."""
        return self._task is None and self.status != TaskStatus.TASK


def shares(rows: int, eligible: list[bool]) -> list[int]:
    """`rows` split as evenly as possible over the eligible ranks, the lower ranks taking the
    remainder: every rank computes the same split from the same flags."""
    ranks = [r for r, ok in enumerate(eligible) if ok]
    split = [0] * len(eligible)
    for i, rank in enumerate(ranks):
        split[rank] = rows // len(ranks) + (1 if i < rows % len(ranks) else 0)
    return split


def merged(ranges: list[RangeRecord]) -> list[RangeRecord]:
    """One rank's ranges of a step in the order it consumed them, a task's consecutive ranges
    joined: the ledger takes each task once per step, continuing its applied prefix."""
    out: list[RangeRecord] = []
    for r in ranges:
        if out and out[-1].task_id == r.task_id and out[-1].offset + out[-1].count == r.offset:
            out[-1] = RangeRecord(task_id=r.task_id, offset=out[-1].offset, count=out[-1].count + r.count)
        else:
            out.append(r)
    return out
