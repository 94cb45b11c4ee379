"""A graceful end before the data is done, as its own small part behind the master's lock: the
operator's `elastic-step stop`, or a preemption (SIGTERM to the master). Either asks rank 0 for a
checkpoint of its next step and says when the job may end, which is once a checkpoint of a step
after the request is handed over (an older one does not count), or, past its deadline, with the
newest checkpoint the job has. The two differ in their deadline (a preemption has the first half
of its grace period) and in the state they end in."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from elastic_step.protocol import EventKind, JobState

STOP_CHECKPOINT_TIMEOUT_S = 300.0


class StopCause(StrEnum):
    """Who asked the job to end early."""

    OPERATOR = "operator"  # `elastic-step stop`: the job ends STOPPED
    PREEMPTION = "preemption"  # SIGTERM to the master: the job ends PREEMPTED

    @property
    def end_state(self) -> JobState:
        return JobState.PREEMPTED if self is StopCause.PREEMPTION else JobState.STOPPED

    @property
    def end_event(self) -> EventKind:
        return EventKind.PREEMPTED if self is StopCause.PREEMPTION else EventKind.STOPPED


@dataclass
class StopRequest:
    at: float
    after_step: int  # the newest applied step when the request came
    deadline: float
    cause: StopCause = StopCause.OPERATOR
    flagged_step: int | None = None  # the checkpoint step rank 0 took for it

    @property
    def checkpoint_now(self) -> bool:
        """Rank 0 should checkpoint its next step (asked until it flags one)."""
        return self.flagged_step is None

    def flagged(self, step: int) -> None:
        """Rank 0 reported step `step` as a checkpoint step."""
        if self.flagged_step is None and step > self.after_step:
            self.flagged_step = step

    def skipped(self, step: int) -> None:
        """The checkpoint of `step` was not taken (a PS job's shards had no cut of it): if it was
        this stop's, rank 0 checkpoints its next step instead."""
        if self.flagged_step == step:
            self.flagged_step = None

    def preempt(self, now: float, timeout_s: float) -> None:
        """A SIGTERM while an operator's stop waits: the job ends preempted, by the sooner deadline."""
        self.cause = StopCause.PREEMPTION
        self.deadline = min(self.deadline, now + timeout_s)

    def outcome(self, handed: list[tuple[int, int]], now: float) -> tuple[int, str] | None:
        """(step, what to record) once the job may end; None while it waits. `handed`: the
        (step, epoch) of the checkpoints handed over just now."""
        done = [step for step, _ in handed if step > self.after_step]
        if done:
            return done[-1], ""
        if now > self.deadline:
            return self.after_step, (f"no checkpoint after step {self.after_step} within {self.deadline - self.at:.0f}s "
                                     f"of the {'SIGTERM' if self.cause is StopCause.PREEMPTION else 'stop'}; "
                                     "a resume continues from the newest earlier checkpoint")
        return None


def new_stop_request(now: float, applied_step: int, cause: StopCause = StopCause.OPERATOR,
                     timeout_s: float | None = None) -> StopRequest:
    timeout = STOP_CHECKPOINT_TIMEOUT_S if timeout_s is None else timeout_s
    return StopRequest(now, applied_step, now + timeout, cause)
