"""The run's per-step metrics: summarised once a second for MLflow, and each step logged once.

Each MLflow metric row costs the master about a millisecond of CPU on a SQLite store, which at
hundreds of steps per second would take a core from the workers: steps are summarised once a
second (and at every change of world size). Every single step is in the run's metrics.jsonl.

float16 passes computed again at a smaller loss scale (an overflow; frameworks/loss_scale.py) are
logged as `fp16_passes_computed_again`, each point the sum over the steps it summarises, and only
where that is not 0: a run with no point of it had no overflow.

A step trained again is not logged again. After a restore from the master's checkpoint, a
regroup that voided steps, or a resumed run, the group trains step numbers it had trained
before; MLflow keeps every value logged, so a metric's history would hold two values of one step
(two points at one x in every chart). The first pass's values stay; the run's `restores` count
says that steps were trained again, and metrics.jsonl holds both passes.
"""

from __future__ import annotations

from typing import Callable

INTERVAL_S = 1.0


class StepMetrics:
    def __init__(self, log_metric: Callable[[str, float, int, float], None], tensorboard, logged_through: int = 0):
        """`log_metric(key, value, step, time)`: MLflow's; `tensorboard`: a TensorBoardLog;
        `logged_through`: the newest step already logged (a reopened run's)."""
        self.log_metric, self.tensorboard = log_metric, tensorboard
        self.logged_through = logged_through
        self.interval_s = INTERVAL_S
        self._window: list[dict] = []
        self._window_start: float | None = None

    def add(self, entry: dict) -> None:
        """One step of the master's StepLog."""
        if entry["step"] <= self.logged_through:
            return
        self.logged_through = entry["step"]
        for key in ("loss", "samples_per_s", "world_size"):
            self.tensorboard.scalar(f"train/{key}", entry[key], entry["step"], entry["time"])
        if self._window and entry["world_size"] != self._window[-1]["world_size"]:
            self.flush()
        self._window.append(entry)
        if entry["time"] - self._window[0]["time"] >= self.interval_s:
            self.flush()

    def flush(self) -> None:
        """Log the steps gathered so far as one point at the newest of them."""
        window, self._window = self._window, []
        if not window:
            return
        last = window[-1]
        span = last["time"] - (self._window_start or window[0]["time"])
        self._window_start = last["time"]
        values = {
            "loss": sum(e["loss"] for e in window) / len(window),
            "world_size": last["world_size"],
            "round": last["round"],
        }
        again = sum(e.get("passes_again", 0) for e in window)
        if again:
            values["fp16_passes_computed_again"] = again
        if span > 0:
            values["samples_per_s"] = sum(e["samples"] for e in window) / span
        for key, value in values.items():
            self.log_metric(key, value, last["step"], last["time"])
