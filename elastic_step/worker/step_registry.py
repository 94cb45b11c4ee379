"""Which training step class trains each TrainingMode: the one place a mode is chosen."""

from __future__ import annotations

from elastic_step.protocol import TrainingMode
from elastic_step.worker.allreduce_step import AllreduceStep
from elastic_step.worker.step_api import StepHost, TrainingStep

STEP_CLASSES: dict[TrainingMode, type[TrainingStep]] = {
    TrainingMode.ALLREDUCE: AllreduceStep,
}


def training_step(mode: TrainingMode, host: StepHost) -> TrainingStep:
    """The step class of `mode`, built for `host`."""
    try:
        step_class = STEP_CLASSES[mode]
    except KeyError:
        raise NotImplementedError(f"training mode {mode!r} has no step class in this worker") from None
    return step_class(host)
