"""The loss scale of float16 training (--precision fp16), kept so that no step is ever skipped.

float16 holds numbers from about 6e-8 to 65504: small gradients of the activations underflow to
zero unless the loss is multiplied by a large factor first, and a factor too large makes them
overflow to inf. torch's GradScaler finds the factor by trial and skips every step whose
gradients overflowed. Here a skipped step would lose its rows after the master counted them
applied, so the rank instead computes the same rows again at half the factor. Each rank scales
its own forward passes and divides its gradients by its own factor before the step is summed (a
power of two: the division is exact), so the sum is in plain float32 and no rank needs another's
factor: a rank that joins, or is relaunched, starts from the first one.

A pass computed again is the same pass at a smaller factor: the model's buffers (BatchNorm's
running statistics) and the random generators (dropout's draws) are put back as they were before
the overflowed pass (torch_trainer._PassStart), so the model is as if the pass ran once."""

from __future__ import annotations

from dataclasses import dataclass

INITIAL = 2.0**16  # GradScaler's first factor
GROWTH_INTERVAL = 2000  # passes without an overflow before the factor doubles (GradScaler's)
FLOOR = 1.0  # gradients that overflow even unscaled are not float16's fault: the job fails on them


@dataclass
class LossScale:
    value: float = INITIAL
    _clean_passes: int = 0
    overflows: int = 0  # passes computed again at a smaller factor, since this rank started

    def overflowed(self) -> bool:
        """The pass at `value` overflowed: halve the factor. False when it is already at the
        floor (the same rows cannot be computed in range at any factor)."""
        self._clean_passes = 0
        if self.value <= FLOOR:
            return False
        self.value /= 2
        self.overflows += 1
        return True

    def passed(self) -> None:
        """A pass came back finite; after GROWTH_INTERVAL in a row, try twice the factor."""
        self._clean_passes += 1
        if self._clean_passes >= GROWTH_INTERVAL:
            self.value *= 2
            self._clean_passes = 0
