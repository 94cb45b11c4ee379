"""TensorBoard scalar event files in JOB_DIR/tensorboard/ (tensorboardX: no TensorFlow import):
loss, samples/s and world size per step, recovery seconds per regroup, validation metrics per
epoch. Writes are queued to tensorboardX's own writer thread, so no caller waits on the disk."""

from __future__ import annotations

import logging
import os

log = logging.getLogger("elastic_step.tracking")

TENSORBOARD_DIR = "tensorboard"


def tensorboard_dir(job_dir: str) -> str:
    return os.path.join(job_dir, TENSORBOARD_DIR)


class TensorBoardLog:
    def __init__(self, job_dir: str):
        self.path = tensorboard_dir(job_dir)
        self._writer = None
        try:
            from tensorboardX import SummaryWriter

            os.makedirs(self.path, exist_ok=True)
            self._writer = SummaryWriter(logdir=self.path, flush_secs=5)
        except Exception as exc:  # TensorBoard files are a convenience: training goes on without them
            log.warning("no TensorBoard event files in %s: %s", self.path, exc)

    def scalar(self, name: str, value: float | None, step: int, walltime: float | None = None) -> None:
        if self._writer is None or value is None:
            return
        try:
            self._writer.add_scalar(name, float(value), global_step=int(step), walltime=walltime)
        except Exception as exc:
            log.warning("TensorBoard scalar %s not written: %s", name, exc)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
