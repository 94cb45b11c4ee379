"""Rank 0's checkpoints: when one is due, and handing it to the master without stopping training.

The master pairs the state with its ledger of the same step; the state is copied to memory at
the step (Trainer.state_snapshot: from a GPU, asynchronous copies into pinned memory, one wait)
and serialised and sent from a background thread, so training waits for neither.

At most MAX_HELD snapshots exist at once: one being sent and one waiting. A snapshot holds a
copy of the whole state (pinned host memory, from a GPU; `to_bytes()` makes one more while it is
sent), so a master or an MLflow slower than the checkpoints are taken would otherwise pile copies
up until the worker ran out of memory. A checkpoint due when both places are taken is put off to
the first later step with room: training never waits for a send (its peers would wait for it in
the next collective, and a slow master would become a collective timeout), and the log says why
the checkpoint came late."""

from __future__ import annotations

import logging
import threading
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
        self._put_off = False  # a due checkpoint found no room: the next step takes it
        self.put_off = 0  # checkpoints put off for want of room, since this worker started

    def due(self, step: int) -> bool:
        """Whether rank 0 checkpoints `step`: every K steps, when the master's epoch in progress
        has moved on, once whenever the master asks (a stop waits for it), and at the first step
        with room after one was put off. True holds a place for the step's copy, which send()
        gives back once it is sent."""
        if not self.every:
            return False
        if not (self._put_off or step % self.every == 0 or self.reporter.epoch > self._epoch
                or self.reporter.checkpoint_requested):
            return False
        self._epoch = self.reporter.epoch
        self.reporter.checkpoint_requested = False
        if self._room.acquire(blocking=False):
            self._put_off = False
            return True
        if not self._put_off:
            self.put_off += 1
            if self.put_off == 1 or self.put_off % 100 == 0:  # a steady slow master would fill the log
                log.warning("checkpoint of step %d put off: the %d before it are still being sent (%d put off so far); "
                            "the master takes checkpoints slower than they are asked for: raise --checkpoint-steps or "
                            "look at the master's MLflow store", step, MAX_HELD, self.put_off)
        self._put_off = True
        return False

    def send(self, round_id: int, step: int, snapshot: Callable[[], StateSnapshot]) -> None:
        """Copy the state now (`snapshot()`: the trainer's state_snapshot) and send it in the
        background, in the place due(step) held for it."""
        try:
            self._sender.submit(self._send, round_id, step, snapshot())
        except BaseException:
            self._room.release()
            raise

    def _send(self, round_id: int, step: int, state: StateSnapshot) -> None:
        try:
            self.client.call("PUT", Route.CHECKPOINT, content=state.to_bytes(),
                             params={"worker_id": self.worker_id, "round_id": round_id, "step": step})
        except Rejected as exc:
            log.warning("checkpoint of step %d refused: %s", step, exc)
        except Exception:  # on this thread, nobody else would hear of it
            log.exception("checkpoint of step %d not sent: it could not be serialised or sent", step)
        finally:
            self._room.release()

    def drain(self) -> None:
        """Wait until every checkpoint handed to `send` has been sent."""
        self._sender.submit(lambda: None).result()
