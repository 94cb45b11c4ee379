"""Rank 0's checkpoints: when one is due, and handing it to the master without stopping training.

The master pairs the state with its ledger of the same step; the state is copied to memory at
the step (Trainer.state_snapshot: from a GPU, asynchronous copies into pinned memory, one wait)
and serialised and sent from a background thread, so training waits for neither.

At most MAX_HELD snapshots exist at once: one being sent and one waiting. A snapshot holds a
copy of the whole state (pinned host memory, from a GPU), so a master or an MLflow slower than
the checkpoints are taken would otherwise pile copies up until the worker ran out of memory. When
both places are taken, the step waits for the older send before it copies its own state: the
checkpoint is still of its step, and the log says why training waited."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from elastic_step.frameworks.api import StateSnapshot
from elastic_step.protocol import Route
from elastic_step.worker.background import StepReporter
from elastic_step.worker.client import MasterClient, Rejected

log = logging.getLogger("elastic_step.worker")

MAX_HELD = 2  # snapshots in memory at once: the one being sent and the next


class Checkpoints:
    def __init__(self, client: MasterClient, worker_id: str, every: int, reporter: StepReporter):
        self.client = client
        self.worker_id = worker_id
        self.every = every  # rank 0 checkpoints every `every` steps and at each epoch's end; 0: never
        self.reporter = reporter  # its replies carry the master's epoch and its "checkpoint now"
        self._epoch = 0  # the epoch in progress at the newest checkpoint
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._room = threading.BoundedSemaphore(MAX_HELD)
        self.waited = 0  # checkpoints whose step waited for an earlier one to be sent

    def due(self, step: int) -> bool:
        """Whether rank 0 checkpoints `step`: every K steps, when the master's epoch in progress
        has moved on, and once whenever the master asks (a stop waits for it)."""
        if not self.every:
            return False
        if step % self.every == 0 or self.reporter.epoch > self._epoch or self.reporter.checkpoint_requested:
            self._epoch = self.reporter.epoch
            self.reporter.checkpoint_requested = False
            return True
        return False

    def send(self, round_id: int, step: int, snapshot: Callable[[], StateSnapshot]) -> None:
        """Copy the state now (`snapshot()`: the trainer's state_snapshot) and send it in the
        background, once there is room for the copy (MAX_HELD)."""
        self._wait_for_room(step)
        try:
            state = snapshot()
        except BaseException:
            self._room.release()
            raise

        def send():
            try:
                self.client.call("PUT", Route.CHECKPOINT, content=state.to_bytes(),
                                 params={"worker_id": self.worker_id, "round_id": round_id, "step": step})
            except Rejected as exc:
                log.warning("checkpoint of step %d refused: %s", step, exc)
            except Exception:  # on this thread, nobody else would hear of it
                log.exception("checkpoint of step %d not sent: it could not be serialised or sent", step)
            finally:
                self._room.release()

        self._sender.submit(send)

    def _wait_for_room(self, step: int) -> None:
        if self._room.acquire(blocking=False):
            return
        started = time.monotonic()
        self._room.acquire()
        self.waited += 1
        # Once in full, then every 100th: a steady master that is too slow would fill the log.
        if self.waited == 1 or self.waited % 100 == 0:
            log.warning("checkpoint of step %d waited %.1f s for an earlier one to be sent (at most %d are held; %d "
                        "checkpoints have waited): the master takes checkpoints slower than they are asked for; raise "
                        "--checkpoint-steps or look at the master's MLflow store", step, time.monotonic() - started,
                        MAX_HELD, self.waited)

    def drain(self) -> None:
        """Wait until every checkpoint handed to `send` has been sent."""
        self._sender.submit(lambda: None).result()
