"""The worker: register, rendezvous, train a round, regroup in process, repeat until done.

Each step is one allreduce of a flat float32 buffer:
  [ summed gradients | samples, summed loss, regroup flag, done flag | (task, offset, count) per rank ]
so every rank learns, in the same collective that applies the step, which rows every rank
consumed. A rank without data contributes zeros; the sum over ranks of the flags makes every
rank stop at the same step.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from enum import StrEnum

import numpy as np

from elastic_step.errors import ElasticStepError, ModelDefinitionError
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
    StepRecord,
    TaskFailedRequest,
    TaskInfo,
    TaskReply,
    TaskRequest,
    TaskStatus,
    this_engine,
)
from elastic_step.worker.background import Heartbeat, StepReporter
from elastic_step.worker.client import MasterClient, Rejected, worker_identity
from elastic_step.worker.collective import Collective, decode_int, encode_int
from elastic_step.worker.preflight import PreflightFailed, check_worker
from elastic_step.worker.rows import Piece, TaskRows, merged, shares
from elastic_step.worker.timing import Phase, StepTimes

log = logging.getLogger("elastic_step.worker")

def next_lineage(lineage: int, step: int, step_summary: np.ndarray) -> int:
    digest = hashlib.blake2b(lineage.to_bytes(8, "little") + step.to_bytes(8, "little", signed=True), digest_size=8)
    digest.update(step_summary.tobytes())
    return int.from_bytes(digest.digest(), "little")


def _rank_entry(ranges: list[RangeRecord]) -> RangeRecord | list[RangeRecord] | None:
    """A rank's part of a step record: nothing, its one range, or its ranges in order."""
    return None if not ranges else ranges[0] if len(ranges) == 1 else ranges


def initial_lineage(kind: str, step: int) -> int:
    digest = hashlib.blake2b(f"{kind}@{step}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little")


class RoundOutcome(StrEnum):
    """How a round ended for this worker."""

    DONE = "done"  # every epoch is applied (rank 0 handed in the model)
    REGROUP = "regroup"  # a peer died, a member joined or left: rendezvous again
    FAILED = "failed"  # the job cannot go on (the loss is not finite): exit


HEADER = 4  # samples, loss, regroup, done
MAX_PIECES = 4  # ranges one rank reports per micro-round (a rank with more reports the rest in the next)
PER_RANK = 1 + 6 * MAX_PIECES  # "may have more rows", then (task, offset, count) per piece: two float halves each


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
        self.trainer = build_trainer(self.model_def, seed=spec.seed)
        if spec.lr_scaling != LrScaling.NONE:
            try:  # a rate that cannot be scaled fails the job now, not at the first step
                self.trainer.scale_learning_rate(1.0)
            except ModelDefinitionError as exc:
                self.heartbeat.halt()
                raise PreflightFailed(str(exc)) from None
        self._warm_up()
        self.collective = Collective(spec.store_host, spec.store_port, spec.collective_timeout_s)
        self.reporter = StepReporter(client, worker_id)
        self._prefetch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self._scratch: np.ndarray | None = None  # a second gradient buffer, for ranks that accumulate
        self.step = -1  # -1: this worker holds no synchronised state yet
        # A digest of every step this worker's state has applied (each step's counts, summed loss
        # and row ranges, which every rank sees alike): equal lineage at equal step, equal state.
        self.lineage = 0
        self.unacked: dict[int, StepRecord] = {}
        self._checkpointed_epoch = 0
        self._checkpoint_sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")

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
                outcome = self._run_round(reply)
                left_round = reply.round_id
                if outcome == RoundOutcome.FAILED:
                    return 1
        finally:
            self.collective.leave()
            self.heartbeat.halt()

    def _rendezvous(self, left_round: int) -> RendezvousReply:
        while True:
            acked = self.heartbeat.acked_step
            for step in [s for s in self.unacked if s <= acked]:
                del self.unacked[step]
            body = RendezvousRequest(
                worker_id=self.worker_id, step=self.step, unacked=list(self.unacked.values()), left_round=left_round
            )
            reply = RendezvousReply(**self.client.call("POST", "/rendezvous", body, timeout=30.0))
            if reply.status != Rendezvous.WAIT:
                return reply

    def _run_round(self, rv: RendezvousReply) -> RoundOutcome:
        self.heartbeat.round_id = rv.round_id
        try:
            self.collective.join(rv.store_prefix, rv.rank, rv.world_size)
            self._share_state(rv)
            self.step = rv.start_step
            self.heartbeat.step = self.step
            self.unacked.clear()  # the master settled every step up to start_step
            log.info("round %d: rank %d of %d from step %d", rv.round_id, rv.rank, rv.world_size, rv.start_step)
            if self.spec.lr_scaling != LrScaling.NONE:
                full_step = rv.world_size * self.spec.minibatch_size  # a step whose every rank has a whole minibatch
                log.info("round %d: learning rate x %.4g (%s: %d of %d rows per full step)", rv.round_id,
                         self.spec.lr_scaling.factor(full_step, self.spec.full_batch), self.spec.lr_scaling, full_step,
                         self.spec.full_batch)
            return self._train(rv)
        except RuntimeError as exc:  # gloo: a peer died or hung
            log.warning("round %d collective failed: %s", rv.round_id, exc)
            try:
                self.client.call("POST", "/collective-failed", CollectiveFailedRequest(worker_id=self.worker_id, round_id=rv.round_id, error=str(exc)))
            except Rejected:
                pass
            return RoundOutcome.REGROUP
        finally:
            self.collective.leave()

    def _share_state(self, rv: RendezvousReply) -> None:
        """Make every member identical to the state source (the highest applied step). Members
        that applied exactly the source's steps already are (the step's allreduce made them so):
        only a joiner, or a rank behind or on another line of steps, is sent the state, so a
        regroup after a death costs no transfer however large the model."""
        started = time.perf_counter()
        source = rv.rank == rv.source_rank
        step, lineage = self.step, self.lineage
        if source and rv.initial_state:  # nobody holds state yet: a checkpoint or a warm start
            self._load_initial_state(rv.initial_state)
            step, lineage = rv.start_step, initial_lineage(rv.initial_state, rv.start_step)
        identities = self.collective.gather_identities(step, lineage)
        source_step, source_lineage = identities[rv.source_rank]
        behind = [r for r, (s, line) in enumerate(identities)
                  if r != rv.source_rank and not (s >= 0 and s == source_step and line == source_lineage)]
        size = 0
        if behind and len(behind) == rv.world_size - 1:  # everyone but the source: one broadcast
            data = self.collective.broadcast_bytes(self.trainer.state_bytes() if source else None, rv.source_rank)
            size = len(data)
            if not source:
                self.trainer.load_state_bytes(data)
        elif behind and source:
            data = self.trainer.state_bytes()
            size = len(data)
            self.collective.send_bytes(data, behind)
        elif rv.rank in behind:
            data = self.collective.recv_bytes(rv.source_rank)
            size = len(data)
            self.trainer.load_state_bytes(data)
        self.lineage = source_lineage
        log.info("round %d: state of rank %d sent to ranks %s (%d bytes) in %.3f s",
                 rv.round_id, rv.source_rank, behind or "none (every member holds it)", size, time.perf_counter() - started)

    # -- the inner loop: steps ----------------------------------------------------------------
    def _fetch(self, round_id: int) -> tuple[TaskStatus, TaskInfo | None, tuple | None]:
        """The next task and its rows. A task that cannot be read is handed back and the next one
        asked for at once, so WAIT always means the master has nothing to give now (it fails the
        job once a task has failed too often)."""
        while True:
            reply = TaskReply(**self.client.call("POST", "/task", TaskRequest(worker_id=self.worker_id, round_id=round_id)))
            if reply.status != TaskStatus.TASK or reply.task is None:
                return reply.status, None, None
            task = reply.task
            try:
                rows = self.reader.read("train", task.shard, task.start, task.count)
                # feed() is row-wise: apply it to the whole task here, off the training thread,
                # and let each step take a slice.
                rows = batch_arrays(self.model_def, rows, self.spec.features, self.spec.label)
            except Exception as exc:
                log.error("task %d: %s", task.id, exc)
                self.client.call("POST", "/task-failed", TaskFailedRequest(worker_id=self.worker_id, task_id=task.id, error=f"{type(exc).__name__}: {exc}"))
                continue
            return TaskStatus.TASK, task, rows

    def _train(self, rv: RendezvousReply) -> RoundOutcome:
        n_grad = self.trainer.num_gradient_values
        buffer = np.zeros(n_grad + HEADER + PER_RANK * rv.world_size, dtype=np.float32)
        # The next task is fetched and read in the background while this one trains, so the
        # HTTP round trip and the Parquet read never stall the step (and so every other rank).
        pending: Future | None = None
        times = StepTimes()

        def take_task():
            nonlocal pending
            future = pending or self._prefetch.submit(self._fetch, rv.round_id)
            pending = None
            result = future.result()
            if result[0] == TaskStatus.TASK:
                pending = self._prefetch.submit(self._fetch, rv.round_id)
            return result

        try:
            return self._steps(rv, buffer, n_grad, times, take_task)
        finally:
            log.info("round %d: %s", rv.round_id, times.summary())

    def _steps(self, rv: RendezvousReply, buffer: np.ndarray, n_grad: int, times: StepTimes, take_task) -> RoundOutcome:
        rank, world = rv.rank, rv.world_size
        fixed = self.spec.global_batch_size  # 0: each rank takes minibatch_size rows per step
        rows = TaskRows(take_task)
        master_done = False
        while True:
            times.start()
            # One step is one or more micro-rounds, each one collective of the buffer. With a
            # fixed global batch, ranks that got fewer rows than their share (their tasks ran
            # out) are made up for in further micro-rounds by ranks that still have rows, until
            # the step holds exactly G rows or nobody has any (the job's end).
            need = shares(fixed, [True] * world)[rank] if fixed else self.spec.minibatch_size
            accumulated: np.ndarray | None = None
            reported = False  # rank 0 sent every applied step before this step's last ask
            summaries: list[np.ndarray] = []
            ranges: list[list[RangeRecord]] = [[] for _ in range(world)]
            while True:
                # The gradients' part is written whole by compute_gradients, or zeroed below when
                # this rank has no rows: zeroing it every step too cost a 34 MB memset per step
                # on an 8.6M-parameter model.
                buffer[n_grad:] = 0.0
                pieces: list[Piece] = []
                regroup = self.heartbeat.latest_round > rv.round_id or self.heartbeat.stop_requested
                if not regroup and not master_done and need > 0:
                    pieces = rows.take(need, MAX_PIECES if fixed else 1)
                    regroup = rows.status == TaskStatus.REGROUP
                    master_done = rows.status == TaskStatus.DONE
                    times.mark(Phase.DATA)
                if pieces:
                    self._gradients(pieces, buffer, n_grad, rank)
                    times.mark(Phase.GRADIENTS)
                else:
                    buffer[:n_grad] = 0.0
                if not rows.ran_out and not master_done and not regroup:
                    buffer[n_grad + HEADER + PER_RANK * rank] = 1.0  # this rank may have more rows
                buffer[n_grad + 2] = 1.0 if regroup else 0.0
                buffer[n_grad + 3] = 1.0 if master_done else 0.0
                self.collective.allreduce_sum(buffer)
                times.mark(Phase.ALLREDUCE)
                if accumulated is not None:
                    buffer[:n_grad + 2] += accumulated
                summaries.append(buffer[n_grad:].copy())
                more = []
                for r in range(world):
                    ranges[r] += self._decode_ranges(buffer, n_grad, r)
                    more.append(buffer[n_grad + HEADER + PER_RANK * r] > 0)
                total = int(round(buffer[n_grad]))
                short = fixed - total
                if not fixed or short <= 0 or buffer[n_grad + 2] > 0 or buffer[n_grad + 3] > 0:
                    break
                if any(more):
                    need = shares(short, more)[rank]
                elif not reported:
                    # Nobody has rows now, but the master may only be behind: it opens the next
                    # epoch once it has taken the steps that finish the current one, and rank 0
                    # reports steps in the background. So rank 0 sends every step it applied and
                    # asks once more, alone. A task means the step goes on; none means every row
                    # left is in this step (the job's end, or an epoch that cannot open before
                    # this step's rows are applied): the step is applied short. Either way the
                    # outcome depends on the rows applied, not on timing.
                    reported = True
                    if rank == 0:
                        self.reporter.flush()
                    need = short if rank == 0 else 0
                else:
                    break
                accumulated = buffer[:n_grad + 2].copy()
            if fixed and buffer[n_grad + 2] > 0:
                return RoundOutcome.REGROUP  # a partial step is dropped: every step holds G rows
            if total > 0:
                loss_sum = float(buffer[n_grad + 1])
                if not math.isfinite(loss_sum):
                    if rank == 0:
                        self.client.call("POST", "/fail", FailJobRequest(
                            worker_id=self.worker_id,
                            reason=f"loss is {loss_sum} at step {self.step + 1}; lower the learning rate or check the data",
                        ))
                    return RoundOutcome.FAILED
                if self.spec.lr_scaling != LrScaling.NONE:
                    self.trainer.scale_learning_rate(self.spec.lr_scaling.factor(total, self.spec.full_batch))
                self.trainer.apply_gradients(buffer[:n_grad], total)
                times.mark(Phase.APPLY)
                self.step += 1
                summary = summaries[0] if len(summaries) == 1 else np.concatenate(summaries)
                self.lineage = next_lineage(self.lineage, self.step, summary)
                self.heartbeat.step = self.step
                record = StepRecord(step=self.step, ranges=[_rank_entry(merged(r)) for r in ranges], samples=total,
                                    loss=loss_sum, time=time.time(), checkpoint=rank == 0 and self._checkpoint_due())
                self.unacked[self.step] = record
                if rank == 0:
                    if record.checkpoint:
                        self._send_checkpoint(rv.round_id)
                    self.reporter.push(rv.round_id, record)
                times.mark(Phase.REPORT)
                times.steps += 1
            if buffer[n_grad + 3] > 0 and total == 0:
                # The master said "done" to a rank: every epoch is applied, so no rank holds rows.
                # Not every rank need have asked (with a fixed global batch a rank whose share is
                # 0 asks for nothing), so one rank's word ends the round for all.
                return self._finish(rv)
            if buffer[n_grad + 2] > 0:
                return RoundOutcome.REGROUP
            if total == 0:
                time.sleep(0.01)  # nobody had data (the epoch's last tasks are in flight)

    def _gradients(self, pieces: list[Piece], buffer: np.ndarray, n_grad: int, rank: int) -> None:
        """This rank's summed gradients, loss and row ranges in its part of the buffer. Pieces
        larger than minibatch_size are cut: that is the most rows one forward pass holds."""
        grads, limit = buffer[:n_grad], self.spec.minibatch_size
        slot = n_grad + HEADER + PER_RANK * rank + 1
        first = True
        for p, piece in enumerate(pieces):
            for start in range(0, piece.count, limit):
                end = min(start + limit, piece.count)
                features, labels = piece.features[start:end], piece.labels[start:end]
                if first:  # straight into the buffer: the common case costs no copy
                    buffer[n_grad + 1] += self.trainer.compute_gradients(features, labels, grads)
                    first = False
                else:
                    if self._scratch is None or self._scratch.size != n_grad:
                        self._scratch = np.zeros(n_grad, dtype=np.float32)
                    buffer[n_grad + 1] += self.trainer.compute_gradients(features, labels, self._scratch)
                    grads += self._scratch
            buffer[n_grad] += piece.count
            for i, value in enumerate((piece.task_id, piece.offset, piece.count)):
                buffer[slot + 6 * p + 2 * i], buffer[slot + 6 * p + 2 * i + 1] = encode_int(value)

    @staticmethod
    def _decode_ranges(buffer: np.ndarray, n_grad: int, rank: int) -> list[RangeRecord]:
        slot = n_grad + HEADER + PER_RANK * rank + 1
        ranges = []
        for p in range(MAX_PIECES):
            task_id, offset, count = (decode_int(buffer[slot + 6 * p + 2 * i], buffer[slot + 6 * p + 2 * i + 1])
                                      for i in range(3))
            if count == 0:
                break  # a rank's pieces fill its slots in order
            ranges.append(RangeRecord(task_id=task_id, offset=offset, count=count))
        return ranges

    # -- checkpoints --------------------------------------------------------------------------
    def _checkpoint_due(self) -> bool:
        every = self.spec.checkpoint_steps
        if not every:
            return False
        if self.step % every == 0 or self.reporter.epoch > self._checkpointed_epoch or self.reporter.checkpoint_requested:
            self._checkpointed_epoch = self.reporter.epoch
            self.reporter.checkpoint_requested = False
            return True
        return False

    def _send_checkpoint(self, round_id: int) -> None:
        """Copy the state to memory now; a background thread hands it to the master, which
        pairs it with its ledger of the same step. Training does not wait."""
        state, step = self.trainer.state_bytes(), self.step

        def send():
            try:
                self.client.call("PUT", "/checkpoint", content=state, params={"worker_id": self.worker_id, "round_id": round_id, "step": step})
            except Rejected as exc:
                log.warning("checkpoint of step %d refused: %s", step, exc)

        self._checkpoint_sender.submit(send)

    def _load_initial_state(self, kind: str) -> None:
        data = self.client.call_bytes("GET", "/initial-state")
        if kind == "checkpoint":
            self.trainer.load_state_bytes(data)
        else:
            self.trainer.load_model_bytes(data)

    def _finish(self, rv: RendezvousReply) -> RoundOutcome:
        """Every rank has heard that all epochs are applied: rank 0 hands in the final model."""
        if rv.rank == 0:
            self._checkpoint_sender.submit(lambda: None).result()  # earlier checkpoints are sent
            self.reporter.flush()
            try:
                self.client.call("PUT", "/model", content=self.trainer.model_bytes(), params={"worker_id": self.worker_id, "step": self.step})
            except Rejected as exc:  # the master no longer agrees the job is done here: regroup
                log.warning("final model refused: %s", exc)
                return RoundOutcome.REGROUP
        return RoundOutcome.DONE


def register(client: MasterClient, worker_id: str) -> JobSpec:
    """The job's spec, or the one line that says why this worker may not join."""
    engine = this_engine()
    request = RegisterRequest(worker_id=worker_id, pid=os.getpid(), host=socket.gethostname(), engine=engine)
    try:
        return JobSpec(**client.call("POST", "/register", request))
    except Rejected as exc:
        if exc.status == 422:  # a master from before workers said which engine they run
            raise ElasticStepError(f"the master at {client.url} cannot read this worker's registration: it runs another "
                                   f"release than this worker's {engine}; give the workers the master's image") from None
        raise ElasticStepError(exc.detail) from None


def run_worker() -> int:
    logging.getLogger().setLevel(logging.INFO)  # worker logs go to JOB_DIR/logs/, read when things go wrong
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per heartbeat
    url, token, worker_id = worker_identity()
    client = MasterClient(url, token)
    spec = register(client, worker_id)
    client.master_timeout_s = spec.master_timeout_s
    try:
        worker = Worker(client, worker_id, spec)
    except PreflightFailed as exc:
        # The master fails the job with this reason (a relaunch would fail the same way).
        try:
            client.call("POST", "/preflight-failed", FailJobRequest(worker_id=worker_id, reason=str(exc)[:4000]))
        except Exception as call_error:  # the master is gone or refuses: the exit says it all the same
            log.warning("could not report the pre-flight failure: %s", call_error)
        raise ElasticStepError(f"pre-flight: {exc}") from None
    return worker.run()
