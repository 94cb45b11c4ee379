"""Rank 0 hands its applied steps to the step reporter in batches, not one by one.

Each hand-over wakes the reporter's thread, and each of its requests costs the master a
request's work on the same cores as the workers; with a step of a few milliseconds a push per
step meant about one request per step or two. So the records gather here and go together every
HAND_OVER_EVERY_S, and at once whenever the master needs them now: a checkpoint's step, a step with no rows (the master opens an epoch once it has
the steps that end the previous one), a flush, the end of a round, and a round's first
AT_ONCE_PER_ROUND steps: after a regroup the master waits for the first to know the group
recovered, and for the second to make the first final (a step is final once the next one is
reported), which is when it reaches the audit; batched, they came up to a hand-over period later.
"""

from __future__ import annotations

import time
from typing import Callable

from elastic_step.protocol import StepRecord

HAND_OVER_EVERY_S = 0.2
AT_ONCE_PER_ROUND = 2


class StepHandOver:
    def __init__(self, push: Callable[[int, StepRecord], None], every_s: float = HAND_OVER_EVERY_S,
                 clock: Callable[[], float] = time.monotonic):
        self._push = push  # the reporter's push(round_id, record)
        self._every_s = every_s
        self._clock = clock
        self._held: list[tuple[int, StepRecord]] = []
        self._handed_at = clock()
        self._round, self._in_round = None, 0  # the round of the last record, and its records so far

    def add(self, round_id: int, record: StepRecord, now: bool = False) -> None:
        """Hold `record`; hand over everything held when `now`, when the record is one of its
        round's first steps, or when the last hand-over is old."""
        self._held.append((round_id, record))
        if round_id != self._round:
            self._round, self._in_round = round_id, 0
        self._in_round += 1
        if now or self._in_round <= AT_ONCE_PER_ROUND or self._clock() - self._handed_at >= self._every_s:
            self.hand_over()

    def hand_over(self) -> None:
        """Push every held record to the reporter, in order (it sends them in its own time)."""
        held, self._held = self._held, []
        for round_id, record in held:
            self._push(round_id, record)
        self._handed_at = self._clock()

    @property
    def held(self) -> int:
        return len(self._held)
