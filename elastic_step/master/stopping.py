"""The operator's graceful stop (`elastic-step stop`), as its own small part behind the master's
lock: it asks rank 0 for a checkpoint of its next step and says when the job may stop, which is
once a checkpoint of a step after the request is handed over (an older one does not count), or,
past its deadline, with the newest checkpoint the job has."""

from __future__ import annotations

from dataclasses import dataclass

STOP_CHECKPOINT_TIMEOUT_S = 300.0


@dataclass
class StopRequest:
    at: float
    after_step: int  # the newest applied step when the operator asked
    deadline: float
    flagged_step: int | None = None  # the checkpoint step rank 0 took for it

    @property
    def checkpoint_now(self) -> bool:
        """Rank 0 should checkpoint its next step (asked until it flags one)."""
        return self.flagged_step is None

    def flagged(self, step: int) -> None:
        """Rank 0 reported step `step` as a checkpoint step."""
        if self.flagged_step is None and step > self.after_step:
            self.flagged_step = step

    def outcome(self, handed: list[tuple[int, int]], now: float) -> tuple[int, str] | None:
        """(step, what to record) once the job may stop; None while it waits. `handed`: the
        (step, epoch) of the checkpoints handed over just now."""
        done = [step for step, _ in handed if step > self.after_step]
        if done:
            return done[-1], ""
        if now > self.deadline:
            return self.after_step, (f"no checkpoint after step {self.after_step} within {STOP_CHECKPOINT_TIMEOUT_S:.0f}s "
                                     "of the stop; a resume continues from the newest earlier checkpoint")
        return None


def new_stop_request(now: float, applied_step: int) -> StopRequest:
    return StopRequest(now, applied_step, now + STOP_CHECKPOINT_TIMEOUT_S)
