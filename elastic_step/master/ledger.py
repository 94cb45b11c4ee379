"""The exactly-once ledger: which rows every applied step consumed.

Rank 0 reports each applied step with the (task, offset, count) range every rank consumed in
it. A reported step is *tentative* until it can no longer be undone: step s is final once step
s+1 is reported (no rank enters step s+1's collective before applying s, so every survivor holds
s), or once every member of its round has said in a heartbeat that it applied s (MasterState's
_held: a round's members beat at once after its first step, so the audit shows a recovery without
waiting for the step after it). A regroup that settles at S voids the tentative steps above S: their rows go back to the
dispatcher and so to todo. S itself stays tentative until the new round's first step: until its
source has broadcast it, only the source holds it. Workers forget a step's ranges only once it is
final (a voided step's number is reused by the next round's step). Only final steps reach the audit
file, which therefore lists every row of every epoch exactly once.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from dataclasses import dataclass
from typing import IO

from elastic_step.master.dispatcher import Dispatcher


class StepGap(ValueError):
    """A step report arrived before the steps in front of it (an earlier report was lost): the
    master regroups, and the new round's state source re-reports what is missing."""


class StepRejected(ValueError):
    """A step whose ranges the ledger cannot take (a task named twice, a range that does not
    continue its task's applied prefix, rows of a task its rank did not hold). Every rank holds
    the same ranges, so no resend or regroup can correct them: the job cannot stay exact."""


@dataclass(frozen=True)
class Consumed:
    task_id: int
    offset: int
    count: int


class Ledger:
    def __init__(self, dispatcher: Dispatcher, audit_path: str | None = None):
        self.dispatcher = dispatcher
        self.applied_step = 0  # newest step ingested
        self.final_step = 0  # newest step that can no longer be voided
        self.rows_final = 0
        self._tentative: dict[int, list[Consumed]] = {}
        # Rows each worker's rank consumed, what status shows per worker: of final steps, and
        # the holders of each tentative step's ranges, so a voided step or a restore takes its
        # rows back from the workers' counts as it does from the dispatcher.
        self._worker_rows_final: Counter[str] = Counter()
        self._tentative_holders: dict[int, list[str]] = {}
        self._audit: IO[str] | None = open(audit_path, "a", encoding="utf-8") if audit_path else None
        # Audit lines of finalized steps not yet written. The master's state sets `defer_audit`
        # and writes them (`write_audit`) once its lock is released; anyone else gets them
        # written at once.
        self.defer_audit = False
        self._unwritten: list[str] = []
        self._audit_lock = threading.Lock()

    def ingest(self, step: int, consumed: list[Consumed], holders: list[str] | None = None) -> bool:
        """Record an applied step; False when it was already known (a repeated report).
        `holders[i]`, where given, is the worker whose rank consumed `consumed[i]`: the task must
        be one the master handed to it. Nothing changes unless the whole step is valid."""
        if step <= self.applied_step:
            return False
        if step != self.applied_step + 1:
            raise StepGap(f"step {step} reported before step {self.applied_step + 1}")
        try:
            self.dispatcher.check_step(
                [(c.task_id, c.offset, c.count, holders[i] if holders else None) for i, c in enumerate(consumed)]
            )
        except ValueError as exc:
            raise StepRejected(f"step {step}: {exc}") from None
        for c in consumed:
            self.dispatcher.mark_applied(c.task_id, c.offset, c.count)
        self._tentative[step] = consumed
        if holders:
            self._tentative_holders[step] = list(holders)
        self.applied_step = step
        self.finalize_through(step - 1)
        return True

    def resume_from(self, step: int, rows_final: int = 0, worker_rows: dict[str, int] | None = None) -> None:
        """Continue after a checkpoint of `step` (its dispatcher restored by the caller): audit
        entries written earlier with a later step are void, which the audit file says for anyone
        reading it. `rows_final`: the rows this ledger had finalized through `step`;
        `worker_rows`: each worker's share of them (`worker_rows(step)` when the checkpoint was taken)."""
        self._tentative.clear()  # their tasks are the restored dispatcher's no longer
        self._tentative_holders.clear()
        self.applied_step = self.final_step = step
        self.rows_final = rows_final
        self._worker_rows_final = Counter(worker_rows or {})
        self._append_audit([json.dumps({"resume_from_step": step})])
        self.write_audit()

    def finalize_through(self, step: int) -> None:
        lines = []
        for s in range(self.final_step + 1, min(step, self.applied_step) + 1):
            for holder, c in zip(self._tentative_holders.pop(s, []), self._tentative[s]):
                self._worker_rows_final[holder] += c.count
            for c in self._tentative.pop(s):
                task = self.dispatcher.tasks[c.task_id]
                self.rows_final += c.count
                lines.append(
                    json.dumps(
                        {
                            "epoch": task.epoch,
                            "shard": self.dispatcher.shard_names[task.shard],
                            "start": task.start + c.offset,
                            "count": c.count,
                            "step": s,
                        }
                    )
                )
            self.final_step = s
        self._append_audit(lines)
        if not self.defer_audit:
            self.write_audit()

    def _append_audit(self, lines: list[str]) -> None:
        if self._audit is not None and lines:
            with self._audit_lock:
                self._unwritten.extend(lines)

    def write_audit(self) -> None:
        """Append the finalized steps' lines to the audit file, whole lines, in step order."""
        with self._audit_lock:
            if self._audit is not None and self._unwritten:
                self._audit.write("\n".join(self._unwritten) + "\n")
                self._audit.flush()
            self._unwritten = []

    def rows_through(self, step: int) -> int:
        """Rows applied in steps up to `step` that this ledger has taken (final or tentative)."""
        return self.rows_final + sum(c.count for s, consumed in self._tentative.items() if s <= step for c in consumed)

    def worker_rows(self, step: int | None = None) -> dict[str, int]:
        """Rows each worker's rank consumed in the steps up to `step` (default: every step taken)
        that this ledger holds: voided steps and steps a restore went back over count no more."""
        rows = Counter(self._worker_rows_final)
        for s, holders in self._tentative_holders.items():
            if step is None or s <= step:
                for holder, c in zip(holders, self._tentative[s]):
                    rows[holder] += c.count
        return dict(rows)

    def tentative(self) -> dict[int, list[Consumed]]:
        """The steps reported but not yet final, with their ranges (a copy)."""
        return {step: list(consumed) for step, consumed in self._tentative.items()}

    def void_after(self, step: int) -> int:
        """Undo tentative steps above `step`; returns how many rows went back."""
        rows = 0
        for s in sorted((s for s in self._tentative if s > step), reverse=True):
            self._tentative_holders.pop(s, None)
            for c in reversed(self._tentative.pop(s)):
                self.dispatcher.unapply(c.task_id, c.count)
                rows += c.count
        self.applied_step = min(self.applied_step, step)
        return rows

    def close(self) -> None:
        self.write_audit()
        with self._audit_lock:
            if self._audit is not None:
                self._audit.close()
                self._audit = None
