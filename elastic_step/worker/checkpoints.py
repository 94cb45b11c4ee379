"""Rank 0's checkpoints: when one is due, and handing it to the master without stopping training.

The master pairs the state with its ledger of the same step; the state is copied to memory at
the step (Trainer.state_snapshot: from a GPU, asynchronous copies into pinned memory, one wait)
and serialised and sent from a background thread, so training waits for neither."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from elastic_step.frameworks.api import StateSnapshot
from elastic_step.protocol import Route
from elastic_step.worker.background import StepReporter
from elastic_step.worker.client import MasterClient, Rejected

log = logging.getLogger("elastic_step.worker")


class Checkpoints:
    def __init__(self, client: MasterClient, worker_id: str, every: int, reporter: StepReporter):
        self.client = client
        self.worker_id = worker_id
        self.every = every  # rank 0 checkpoints every `every` steps and at each epoch's end; 0: never
        self.reporter = reporter  # its replies carry the master's epoch and its "checkpoint now"
        self._epoch = 0  # the epoch in progress at the newest checkpoint
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")

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

    def send(self, round_id: int, step: int, state: StateSnapshot) -> None:
        def send():
            try:
                self.client.call("PUT", Route.CHECKPOINT, content=state.to_bytes(),
                                 params={"worker_id": self.worker_id, "round_id": round_id, "step": step})
            except Rejected as exc:
                log.warning("checkpoint of step %d refused: %s", step, exc)
            except Exception:  # on this thread, nobody else would hear of it
                log.exception("checkpoint of step %d not sent: it could not be serialised or sent", step)

        self._sender.submit(send)

    def drain(self) -> None:
        """Wait until every checkpoint handed to `send` has been sent."""
        self._sender.submit(lambda: None).result()
