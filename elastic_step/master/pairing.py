"""Checkpoint pairing: a checkpoint is two halves that reach the master apart, and is handed
over only once both belong to the same step of the same lineage.

- the ledger as of step s, taken when rank 0's report of s (flagged as a checkpoint step) is
  ingested, and
- rank 0's model state after s, uploaded in the background.

A pair is handed over once s is final (it can no longer be voided). A state sent by a rank 0 of
another round than the one whose report gave the ledger is no half of that checkpoint; a voided
step's halves are dropped. This runs under the master's one lock, like everything it pairs;
the handed-over pairs are written (`on_checkpoint`) by the master once that lock is released.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

# A flagged step whose state never came (rank 0 died first) is given up this many steps later.
GIVE_UP_AFTER_STEPS = 1000


@dataclass(frozen=True)
class HandedCheckpoint:
    """A complete pair, of a final step: what `on_checkpoint` is given."""

    step: int
    epoch: int
    state: bytes
    ledger: dict
    rows_final: int = 0  # rows the master's ledger holds through `step`: a restore's audit count
    worker_rows: dict = field(default_factory=dict)  # each worker's share of them: a restore's per-worker rows


@dataclass
class PendingCheckpoint:
    ledger: dict | None = None
    epoch: int = 0
    rows_final: int = 0
    worker_rows: dict = field(default_factory=dict)
    state: bytes | None = None
    round_id: int = 0  # the round whose rank 0 sent the state


class CheckpointPairing:
    def __init__(self, on_checkpoint: Callable[[int, int, bytes, dict], bool | None] | None):
        # (step, epoch, state, ledger): the tracking side; False when it did not take it (a PS cut missing)
        self.on_checkpoint = on_checkpoint
        self._pending: dict[int, PendingCheckpoint] = {}

    @property
    def enabled(self) -> bool:
        return self.on_checkpoint is not None

    def ledger_at(self, step: int, ledger: dict, epoch: int, round_id: int, rows_final: int = 0,
                  worker_rows: dict | None = None) -> None:
        """The ledger half of step `step`, reported in round `round_id`."""
        pending = self._pending.setdefault(step, PendingCheckpoint())
        pending.ledger, pending.epoch, pending.rows_final = ledger, epoch, rows_final
        pending.worker_rows = dict(worker_rows or {})
        if pending.state is not None and pending.round_id != round_id:
            pending.state = None  # sent by a rank 0 of another round: not this step's state

    def state_at(self, step: int, state: bytes, round_id: int) -> None:
        """The model state half of step `step`, from rank 0 of round `round_id`."""
        if self.enabled:
            pending = self._pending.setdefault(step, PendingCheckpoint())
            pending.state, pending.round_id = state, round_id

    def void_after(self, step: int) -> None:
        """A regroup voided the steps above `step`: their halves are no cut at all."""
        for voided in [s for s in self._pending if s > step]:
            del self._pending[voided]

    def hand_over(self, final_step: int) -> list[HandedCheckpoint]:
        """Every complete pair up to `final_step`, oldest first, taken out of pairing; the
        caller writes them (`on_checkpoint`), off the master's lock."""
        handed = []
        for step in sorted(self._pending):
            pending = self._pending[step]
            if step > final_step:
                break
            if pending.ledger is not None and pending.state is not None:
                del self._pending[step]
                handed.append(HandedCheckpoint(step, pending.epoch, pending.state, pending.ledger, pending.rows_final,
                                               pending.worker_rows))
            elif pending.ledger is None or step < final_step - GIVE_UP_AFTER_STEPS:
                # A state for a step nobody flagged (voided), or a flagged step whose state
                # never came (rank 0 died first): no consistent cut, drop it.
                del self._pending[step]
        return handed

    def __bool__(self) -> bool:
        return bool(self._pending)
