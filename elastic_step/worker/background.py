"""The worker's two background threads: heartbeats (which also bring news of a new round) and
rank 0's step reporter (which sends applied steps in batches, off the training path). Neither
ends the process: one that finds the master gone says so (leaving.depart) and the main thread
leaves."""

from __future__ import annotations

import logging
import queue
import threading
import time

from elastic_step.protocol import HeartbeatRequest, Route, StepRecord, StepsRequest
from elastic_step.worker.client import MasterClient, MasterGone, Rejected
from elastic_step.worker.leaving import LeaveReason, depart
from elastic_step.worker.resources import ResourceSampler

log = logging.getLogger("elastic_step.worker")


class Heartbeat(threading.Thread):
    def __init__(self, client: MasterClient, worker_id: str, interval_s: float):
        super().__init__(name="heartbeat", daemon=True)
        self.client = client
        self.worker_id = worker_id
        self.interval_s = interval_s
        # (round, newest step this worker applied in it; -1 before its state is shared): one
        # tuple, read whole, so that no beat pairs a new round with a step of the last one. The
        # master counts a step as final once every member of its round has said it holds it.
        self.position = (0, -1)
        self.latest_round = 0
        self.acked_step = 0
        self.stop_requested = False
        self._halt = threading.Event()
        self._wake = threading.Event()
        self._sampler: ResourceSampler | None = None

    def _resources(self):
        """This process's CPU, memory and GPUs for the heartbeat (None if they cannot be read:
        the heartbeat matters more than its figures)."""
        try:
            if self._sampler is None:
                self._sampler = ResourceSampler()
            return self._sampler.sample()
        except Exception as exc:
            log.debug("no resource figures: %s", exc)
            return None

    def run(self) -> None:
        while not self._halt.is_set():
            self._wake.clear()
            round_id, step = self.position
            try:
                reply = self.client.call(
                    "POST", Route.HEARTBEAT,
                    HeartbeatRequest(worker_id=self.worker_id, round_id=round_id, step=step, resources=self._resources()),
                )
            except MasterGone as exc:
                # No master: nobody will ever tell this worker to stop. The main thread leaves
                # (leaving.py); this thread's work is over.
                depart(LeaveReason.MASTER_GONE, str(exc))
                return
            except Rejected as exc:
                log.warning("heartbeat rejected: %s", exc)
            else:
                self.latest_round = reply["round_id"]
                self.acked_step = reply["acked_step"]
                self.stop_requested = reply["action"] == "stop"
            self._wake.wait(self.interval_s)

    def beat_now(self) -> None:
        """Send the next beat at once (a round's first step: the master makes it final, and the
        audit shows the recovery, without waiting for the round's second step)."""
        self._wake.set()

    def halt(self) -> None:
        self._halt.set()
        self._wake.set()


class StepReporter(threading.Thread):
    """Rank 0 reports applied steps in order; the master's acknowledgement lets every rank
    forget the ranges of steps the master holds."""

    def __init__(self, client: MasterClient, worker_id: str):
        super().__init__(name="step-reporter", daemon=True)
        self.client = client
        self.worker_id = worker_id
        self._queue: queue.Queue[tuple[int, StepRecord]] = queue.Queue()
        # Rank 0 checkpoints its next step whenever the master's epoch in progress (from its
        # replies) moves on, and when the master asks for a checkpoint now (the job is stopping:
        # it asks until a checkpoint step reaches it; one request, one checkpoint).
        self.epoch = 0
        self.checkpoint_requested = False
        self._asked = False

    def _take_reply(self, reply: dict) -> None:
        asked = bool(reply.get("checkpoint_now", False))
        if asked and not self._asked:
            self.checkpoint_requested = True
        self._asked = asked
        self.epoch = max(self.epoch, reply.get("epoch", 0))

    def push(self, round_id: int, record: StepRecord) -> None:
        self._queue.put((round_id, record))

    def flush(self) -> None:
        """Wait until every pushed step has been sent."""
        self._queue.join()

    def run(self) -> None:
        while True:
            batch = [self._queue.get()]
            time.sleep(0.05)  # let steps gather: one request carries many, and the master stays idle
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            for round_id in sorted({r for r, _ in batch}):
                steps = [rec for r, rec in batch if r == round_id]
                try:
                    reply = self.client.call("POST", Route.STEPS, StepsRequest(worker_id=self.worker_id, round_id=round_id, steps=steps))
                    self._take_reply(reply)
                except Rejected as exc:
                    # The ranges stay with every rank until acknowledged, and the next regroup
                    # settles them from the state source: nothing is lost by dropping the report.
                    log.warning("step report rejected: %s", exc)
                except MasterGone as exc:
                    # The main thread leaves (leaving.py); this thread goes on marking its
                    # batches sent, so that nothing waiting on `flush` waits for ever.
                    depart(LeaveReason.MASTER_GONE, str(exc))
            for _ in batch:
                self._queue.task_done()
