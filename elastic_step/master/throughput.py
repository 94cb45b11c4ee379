"""What /status says of training speed: samples per second over the newest steps, and the
newest step's mean loss."""

from __future__ import annotations

import collections
import math

WINDOW_STEPS = 64


class Throughput:
    def __init__(self):
        self._window: collections.deque[tuple[float, int]] = collections.deque(maxlen=WINDOW_STEPS)
        self._last_loss = float("nan")

    def add(self, time: float, samples: int, loss_sum: float) -> None:
        """One applied step: when it was applied, its samples and their summed loss."""
        self._window.append((time, samples))
        self._last_loss = loss_sum / max(samples, 1)

    @property
    def loss(self) -> float | None:
        return self._last_loss if math.isfinite(self._last_loss) else None

    def samples_per_second(self) -> float:
        window = list(self._window)
        if len(window) < 2 or window[-1][0] <= window[0][0]:
            return 0.0
        return sum(n for _, n in window[1:]) / (window[-1][0] - window[0][0])
