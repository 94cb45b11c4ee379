"""Which training step class trains each TrainingMode: the one place a mode is chosen."""

from __future__ import annotations

from typing import Callable

from elastic_step.protocol import TrainingMode
from elastic_step.worker.allreduce_step import AllreduceStep
from elastic_step.worker.step_api import StepHost, TrainingStep


def _ps_step(host: StepHost) -> TrainingStep:
    from elastic_step.worker.ps_step import PsStep  # imports torch: only a PS-mode worker pays for it

    return PsStep(host)


STEP_CLASSES: dict[TrainingMode, type[TrainingStep] | Callable[[StepHost], TrainingStep]] = {
    TrainingMode.ALLREDUCE: AllreduceStep,
    TrainingMode.PS: _ps_step,
}


def training_step(mode: TrainingMode, host: StepHost) -> TrainingStep:
    """The step class of `mode`, built for `host`."""
    try:
        step_class = STEP_CLASSES[mode]
    except KeyError:
        raise NotImplementedError(f"training mode {mode!r} has no step class in this worker") from None
    return step_class(host)
