"""The worker: register, rendezvous, train a round, regroup in process, repeat until done.

The Worker does what every training mode needs: rendezvous, make the round's members identical
(state sharing, state_sharing.py), report applied steps, checkpoints and the final model. How a
round's steps are trained is the job's TrainingMode's step class (step_registry.py): the
allreduce step, say, sums each step's gradients and row ranges in one collective
(allreduce_step.py).
"""

from __future__ import annotations

import logging
import os
import socket
import time

from elastic_step.allocator import keep_step_memory
from elastic_step.errors import ConfigError, ElasticStepError, ModelDefinitionError
from elastic_step.frameworks.device import placement_here, worker_slot
from elastic_step.frameworks.model_def import batch_arrays
from elastic_step.frameworks.registry import build_trainer
from elastic_step.protocol import (
    CollectiveFailedRequest,
    FailJobRequest,
    JobSpec,
    LrScaling,
    RangeRecord,
    RegisterRequest,
    Rendezvous,
    RendezvousReply,
    RendezvousRequest,
    Route,
    StepRecord,
    this_engine,
)
from elastic_step.worker.background import Heartbeat, StepReporter
from elastic_step.worker.checkpoints import Checkpoints
from elastic_step.worker.client import MasterClient, Rejected, worker_identity
from elastic_step.worker.allreduce_step import where_the_step_lives
from elastic_step.worker.collective import Collective, CommunicatorLost
from elastic_step.worker.handover import StepHandOver
from elastic_step.worker.preflight import PreflightFailed, check_worker
from elastic_step.worker.rows import merged
from elastic_step.worker.state_sharing import share_state
from elastic_step.worker.step_api import Progress, RoundOutcome
from elastic_step.worker.step_registry import training_step
from elastic_step.worker.tasks import TaskFeed

log = logging.getLogger("elastic_step.worker")

# Test-only and off unless set: "WORKER_ID:SECONDS" holds that worker so long between its first
# ready rendezvous reply and the round's meeting, so that a test can SIGKILL it while the other
# members wait there for it (tests/test_round_meeting.py).
HOLD_BEFORE_MEETING_ENV = "ELASTIC_STEP_TEST_HOLD_BEFORE_MEETING"


def hold_before_meeting(worker_id: str, environ=os.environ) -> float:
    """Seconds this worker waits before its first meeting (0 unless the test hook names it)."""
    named, _, seconds = environ.get(HOLD_BEFORE_MEETING_ENV, "").partition(":")
    return float(seconds) if named == worker_id and seconds else 0.0


def _rank_entry(ranges: list[RangeRecord]) -> RangeRecord | list[RangeRecord] | None:
    """A rank's part of a step record: nothing, its one range, or its ranges in order."""
    return None if not ranges else ranges[0] if len(ranges) == 1 else ranges


class Worker:
    def __init__(self, client: MasterClient, worker_id: str, spec: JobSpec):
        self.client = client
        self.worker_id = worker_id
        self.spec = spec
        # Heartbeats start before the model definition is imported: importing its framework
        # (TensorFlow takes seconds, more on a busy node) must not look like a hung worker.
        self.heartbeat = Heartbeat(client, worker_id, spec.heartbeat_interval_s)
        self.heartbeat.start()
        try:
            self.model_def, self.reader = check_worker(spec.model_def, spec.manifest)
        except PreflightFailed:
            self.heartbeat.halt()
            raise
        self.placement, self.trainer = self._trainer_on_its_device(worker_id)
        if spec.lr_scaling != LrScaling.NONE:
            try:  # a rate that cannot be scaled fails the job now, not at the first step
                self.trainer.scale_learning_rate(1.0)
            except ModelDefinitionError as exc:
                self.heartbeat.halt()
                raise PreflightFailed(str(exc)) from None
        self.collective = Collective(spec.store_host, spec.store_port, spec.collective_timeout_s, link_key=client.token.encode(),
                                     gpu=self.placement.device if self.placement.on_gpu else None)
        self.reporter = StepReporter(client, worker_id)
        self.handover = StepHandOver(self.reporter.push)  # rank 0's records, to the reporter in batches
        self.tasks = TaskFeed(client, worker_id, self.reader, self.model_def, spec)
        self.checkpoints = Checkpoints(client, worker_id, spec.checkpoint_steps, self.reporter)
        self.progress = Progress()
        self.steps = training_step(spec.mode, self)
        log.info("%s", where_the_step_lives(self.collective.backend, self.steps.buffer_device()))
        self._warm_up()  # after the step is built: a PS step gives the model's tables their shards first
        self._hold_s = hold_before_meeting(worker_id)

    def _trainer_on_its_device(self, worker_id: str):
        """The trainer on the device the placement rule gives this worker's slot; a device or
        precision it cannot have fails the job at pre-flight, in one line, not at a step."""
        try:
            placement = placement_here(self.spec.device, self.spec.precision, slot=worker_slot(worker_id))
            trainer = build_trainer(self.model_def, seed=self.spec.seed, placement=placement)
        except ConfigError as exc:
            self.heartbeat.halt()
            raise PreflightFailed(str(exc)) from None
        log.info("computing on %s in %s (%s)", placement.device, placement.precision.value, placement.reason)
        return placement, trainer

    def _warm_up(self) -> None:
        """Trace the training step on a couple of rows before the first rendezvous: the master
        counts a worker into rounds once it calls in, and from then on every rank waits for it."""
        try:
            rows = self.reader.read("train", 0, 0, min(2, self.reader.manifest.splits["train"][0].rows))
            self.trainer.warm_up(*batch_arrays(self.model_def, rows, self.spec.features, self.spec.label))
        except Exception as exc:  # only a speed-up: a task that cannot be read fails on its own later
            log.warning("warm-up skipped: %s: %s", type(exc).__name__, exc)

    # -- the outer loop: rounds ------------------------------------------------------------------
    def run(self) -> int:
        self.reporter.start()
        left_round = 0
        try:
            while True:
                reply = self._rendezvous(left_round)
                if reply.status != Rendezvous.READY:
                    return 0
                try:
                    outcome = self._run_round(reply)
                except CommunicatorLost as exc:
                    log.error("round %d: %s", reply.round_id, exc)
                    return 1
                left_round = reply.round_id
                if outcome == RoundOutcome.FAILED:
                    return 1
        finally:
            self.collective.leave()
            self.heartbeat.halt()

    def _rendezvous(self, left_round: int) -> RendezvousReply:
        unacked = self.progress.unacked
        while True:
            acked = self.heartbeat.acked_step
            for step in [s for s in unacked if s <= acked]:
                del unacked[step]
            body = RendezvousRequest(worker_id=self.worker_id, step=self.progress.step,
                                     unacked=list(unacked.values()), left_round=left_round)
            reply = RendezvousReply(**self.client.call("POST", Route.RENDEZVOUS, body, timeout=30.0))
            if reply.status != Rendezvous.WAIT:
                return reply

    def _run_round(self, rv: RendezvousReply) -> RoundOutcome:
        self.heartbeat.position = (rv.round_id, -1)
        if self._hold_s:
            log.warning("round %d: held %.1f s before the meeting (%s)", rv.round_id, self._hold_s, HOLD_BEFORE_MEETING_ENV)
            time.sleep(self._hold_s)
            self._hold_s = 0.0
        try:
            # A member missing at the meeting is given up on once the master proposes a newer round.
            self.collective.join(rv.store_prefix, rv.rank, rv.world_size, give_up=lambda: self.regroup_due(rv.round_id))
            share_state(rv, self.progress, self.collective, self.trainer, self.client)
            self.progress.step = rv.start_step
            self.heartbeat.position = (rv.round_id, rv.start_step)
            self.progress.unacked.clear()  # the master settled every step up to start_step
            log.info("round %d: rank %d of %d from step %d", rv.round_id, rv.rank, rv.world_size, rv.start_step)
            if self.spec.lr_scaling != LrScaling.NONE:
                full_step = rv.world_size * self.spec.minibatch_size  # a step whose every rank has a whole minibatch
                log.info("round %d: learning rate x %.4g (%s: %d of %d rows per full step)", rv.round_id,
                         self.spec.lr_scaling.factor(full_step, self.spec.full_batch), self.spec.lr_scaling, full_step,
                         self.spec.full_batch)
            return self.steps.train_round(rv)
        except RuntimeError as exc:  # a peer died or hung, or the master moved on (CollectiveAbandoned)
            log.warning("round %d collective failed: %s", rv.round_id, exc)
            try:
                self.client.call("POST", Route.COLLECTIVE_FAILED, CollectiveFailedRequest(worker_id=self.worker_id, round_id=rv.round_id, error=str(exc)))
            except Rejected:
                pass
            return RoundOutcome.REGROUP
        finally:
            self.handover.hand_over()  # the round's last steps go now, not after the rendezvous
            self.collective.leave()

    # -- what a training step asks of its worker (step_api.StepHost) -----------------------------
    def task_taker(self, round_id: int):
        return self.tasks.taker(round_id)

    def regroup_due(self, round_id: int) -> bool:
        return self.heartbeat.latest_round > round_id or self.heartbeat.stop_requested

    def flush_reports(self) -> None:
        self.handover.hand_over()
        self.reporter.flush()

    def send_reports(self) -> None:
        self.handover.hand_over()

    def record_step(self, rv: RendezvousReply, ranges: list[list[RangeRecord]], samples: int, loss: float,
                    passes_again: int = 0) -> None:
        """Every rank keeps the step's record until the master acknowledges it; rank 0 reports it,
        with the model's state when the step is a checkpoint's."""
        step = self.progress.step
        self.heartbeat.position = (rv.round_id, step)
        if step == rv.start_step + 1:
            self.heartbeat.beat_now()
        record = StepRecord(step=step, ranges=[_rank_entry(merged(r)) for r in ranges], samples=samples, loss=loss,
                            passes_again=passes_again, time=time.time(), checkpoint=rv.rank == 0 and self.checkpoints.due(step))
        self.progress.unacked[step] = record
        if rv.rank == 0:
            if record.checkpoint:  # copied now, serialised and sent in the background
                self.checkpoints.send(rv.round_id, step, self.trainer.state_snapshot)
            self.handover.add(rv.round_id, record, now=record.checkpoint)

    def fail_job(self, reason: str) -> None:
        self.client.call("POST", Route.FAIL, FailJobRequest(worker_id=self.worker_id, reason=reason))

    def finish(self, rv: RendezvousReply) -> RoundOutcome:
        """Every rank has heard that all epochs are applied: rank 0 hands in the final model."""
        if rv.rank == 0:
            self.checkpoints.drain()  # earlier checkpoints are sent
            self.flush_reports()
            try:
                self.client.call("PUT", Route.MODEL, content=self.trainer.model_bytes(),
                                 params={"worker_id": self.worker_id, "step": self.progress.step})
            except Rejected as exc:  # the master no longer agrees the job is done here: regroup
                log.warning("final model refused: %s", exc)
                return RoundOutcome.REGROUP
        return RoundOutcome.DONE


def register(client: MasterClient, worker_id: str) -> JobSpec:
    """The job's spec, or the one line that says why this worker may not join."""
    engine = this_engine()
    request = RegisterRequest(worker_id=worker_id, pid=os.getpid(), host=socket.gethostname(), engine=engine)
    try:
        return JobSpec(**client.call("POST", Route.REGISTER, request))
    except Rejected as exc:
        if exc.status == 422:  # a master from before workers said which engine they run
            raise ElasticStepError(f"the master at {client.url} cannot read this worker's registration: it runs another "
                                   f"release than this worker's {engine}; give the workers the master's image") from None
        raise ElasticStepError(exc.detail) from None


def run_worker() -> int:
    logging.getLogger().setLevel(logging.INFO)  # worker logs go to JOB_DIR/logs/, read when things go wrong
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per heartbeat
    keep_step_memory()
    url, token, worker_id = worker_identity()
    client = MasterClient(url, token)
    spec = register(client, worker_id)
    client.master_timeout_s = spec.master_timeout_s
    try:
        worker = Worker(client, worker_id, spec)
    except PreflightFailed as exc:
        # The master fails the job with this reason (a relaunch would fail the same way).
        try:
            client.call("POST", Route.PREFLIGHT_FAILED, FailJobRequest(worker_id=worker_id, reason=str(exc)[:4000]))
        except Exception as call_error:  # the master is gone or refuses: the exit says it all the same
            log.warning("could not report the pre-flight failure: %s", call_error)
        raise ElasticStepError(f"pre-flight: {exc}") from None
    return worker.run()
