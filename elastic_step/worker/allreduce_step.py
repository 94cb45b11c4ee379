"""The allreduce training mode: every rank holds the whole model, and each step sums every
rank's gradients, counts, flags and row ranges in one collective of a StepBuffer.

A rank without data contributes zeros; a flag any rank sets reaches every rank in the same sum,
so every rank stops at the same step. With a fixed global batch (--global-batch-size G) a step
is one or more micro-rounds, each one collective: ranks that got fewer rows than their share
(their tasks ran out) are made up for in further micro-rounds by ranks that still have rows,
until the step holds exactly G rows or nobody has any (the job's end).
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np

from elastic_step.protocol import LrScaling, RangeRecord, RendezvousReply, TaskStatus
from elastic_step.worker.rows import Piece, TaskRows, shares
from elastic_step.worker.step_api import RoundOutcome, StepHost, TrainingStep
from elastic_step.worker.step_buffer import MAX_PIECES, StepBuffer
from elastic_step.worker.timing import Phase, StepTimes

log = logging.getLogger("elastic_step.worker")


def resident_device(collective_device, trainer_device):
    """AllreduceStep.buffer_device: the trainer's device when the collective sums there, else None."""
    if trainer_device is None or collective_device != trainer_device:
        return None
    return trainer_device


def where_the_step_lives(backend: str, device) -> str:
    """Where a step buffer lives and what sums it, and why that, for the worker's log."""
    return f"step buffer in {f'{device} memory' if device else 'host memory (numpy)'}, summed by {_summed_by(backend, device)}"


def _summed_by(backend: str, device) -> str:
    if backend == "nccl":
        if device is not None:
            return "NCCL's own allreduce, in place (its ring is the GPU's fastest path; the peer links sum host memory)"
        return "NCCL through its GPU, one copy each way (this trainer does not compute on that GPU)"
    return ("the round's peer links: a direct exchange, or in parts past 16 MiB (one or two hops where gloo's ring takes "
            "2(N-1))")


def next_lineage(lineage: int, step: int, step_summary: np.ndarray) -> int:
    """The lineage after applying `step`, whose micro-rounds' summaries are `step_summary`."""
    digest = hashlib.blake2b(lineage.to_bytes(8, "little") + step.to_bytes(8, "little", signed=True), digest_size=8)
    digest.update(step_summary.tobytes())
    return int.from_bytes(digest.digest(), "little")


@dataclass
class _Round:
    """One round as this rank trains it."""

    rv: RendezvousReply
    buffer: StepBuffer
    rows: TaskRows
    times: StepTimes = field(default_factory=StepTimes)
    master_done: bool = False  # the master said every row is applied: ask it for no more


@dataclass
class _Gathered:
    """What a step's micro-rounds brought together: their summaries (for the lineage) and
    every rank's ranges, in rank order."""

    summaries: list[np.ndarray]
    ranges: list[list[RangeRecord]]


class AllreduceStep(TrainingStep):
    def __init__(self, host: StepHost):
        super().__init__(host)
        self._scratch = None  # a second gradient buffer, for ranks that accumulate (beside the buffer's)

    def buffer_device(self):
        """Where the step buffer lives: on the trainer's own device when the collective sums
        there (host memory on the CPU; the GPU's memory when NCCL sums on the trainer's GPU), so
        that the trainer computes into it and applies from it in place; None: a numpy buffer in
        host memory, copied to and from the trainer (a Keras trainer; a GPU trainer whose step
        gloo sums in host memory)."""
        return resident_device(self.host.collective.device, self.host.trainer.gradient_device)

    def train_round(self, rv: RendezvousReply) -> RoundOutcome:
        buffer = StepBuffer(self.host.trainer.num_gradient_values, rv.world_size, rv.rank, self.buffer_device())
        r = _Round(rv, buffer, TaskRows(self.host.task_taker(rv.round_id)))
        try:
            while True:
                r.times.start()
                outcome = self._step(r)
                if outcome is not None:
                    return outcome
        finally:
            log.info("round %d: %s", rv.round_id, r.times.summary())

    def _step(self, r: _Round) -> RoundOutcome | None:
        """One step: gather it, apply it; the round's outcome if it ends here."""
        fixed = self.host.spec.global_batch_size
        gathered = self._gather(r)
        buffer = r.buffer
        if fixed and buffer.regroup:
            return RoundOutcome.REGROUP  # a partial step is dropped: every step holds G rows
        total = buffer.samples
        if total > 0 and not self._apply(r, gathered):
            return RoundOutcome.FAILED
        if buffer.done and total == 0:
            # The master said "done" to a rank: every epoch is applied, so no rank holds rows.
            # Not every rank need have asked (with a fixed global batch a rank whose share is
            # 0 asks for nothing), so one rank's word ends the round for all.
            return self.host.finish(r.rv)
        if buffer.regroup:
            return RoundOutcome.REGROUP
        if total == 0:
            # Nobody had data: the epoch's last tasks are in flight, or the master opens the next
            # epoch once it has the steps that end this one, so rank 0 sends those now.
            self.host.send_reports()
            time.sleep(0.01)
        return None

    def _gather(self, r: _Round) -> _Gathered:
        """The step's micro-rounds, until it holds G rows (fixed global batch) or one is enough."""
        rank, world, fixed = r.rv.rank, r.rv.world_size, self.host.spec.global_batch_size
        need = shares(fixed, [True] * world)[rank] if fixed else self.host.spec.minibatch_size
        accumulated: tuple | None = None
        reported = False  # rank 0 sent every applied step before this step's last ask
        gathered = _Gathered([], [[] for _ in range(world)])
        while True:
            self._micro_round(r, need, accumulated)
            buffer = r.buffer
            gathered.summaries.append(buffer.summary())
            for q in range(world):
                gathered.ranges[q] += buffer.ranges_of(q)
            short = fixed - buffer.samples
            if not fixed or short <= 0 or buffer.regroup or buffer.done:
                return gathered
            more = [buffer.may_have_more(q) for q in range(world)]
            if any(more):
                need = shares(short, more)[rank]
            elif not reported:
                # Nobody has rows now, but the master may only be behind: it opens the next epoch
                # once it has taken the steps that finish the current one, and rank 0 reports
                # steps in the background. So rank 0 sends every step it applied and asks once
                # more, alone. A task means the step goes on; none means every row left is in
                # this step (the job's end, or an epoch that cannot open before this step's rows
                # are applied): the step is applied short. Either way the outcome depends on the
                # rows applied, not on timing.
                reported = True
                if rank == 0:
                    self.host.flush_reports()
                need = short if rank == 0 else 0
            else:
                return gathered
            accumulated = buffer.held_sums()

    def _micro_round(self, r: _Round, need: int, accumulated: tuple | None) -> None:
        """Take up to `need` rows, compute their gradients, and sum the buffer over every rank
        (adding what the step's earlier micro-rounds summed)."""
        buffer, times = r.buffer, r.times
        buffer.clear_meta()
        pieces: list[Piece] = []
        regroup = self.host.regroup_due(r.rv.round_id)
        if not regroup and not r.master_done and need > 0:
            pieces = r.rows.take(need, MAX_PIECES if self.host.spec.global_batch_size else 1)
            regroup = r.rows.status == TaskStatus.REGROUP
            r.master_done = r.rows.status == TaskStatus.DONE
            times.mark(Phase.DATA)
        if pieces:
            self._gradients(pieces, buffer)
            times.mark(Phase.GRADIENTS)
        else:
            buffer.zero_gradients()
        buffer.set_flags(regroup=regroup, done=r.master_done,
                         may_have_more=not r.rows.ran_out and not r.master_done and not regroup)
        buffer.sum_over(self.host.collective)
        times.mark(Phase.ALLREDUCE)
        if accumulated is not None:
            buffer.add_sums(accumulated)

    def _gradients(self, pieces: list[Piece], buffer: StepBuffer) -> None:
        """This rank's summed gradients, loss and row ranges in its part of the buffer. Pieces
        larger than minibatch_size are cut: that is the most rows one forward pass holds."""
        trainer, grads, limit = self.host.trainer, buffer.gradients, self.host.spec.minibatch_size
        passes_again = trainer.passes_computed_again
        first = True
        for p, piece in enumerate(pieces):
            for start in range(0, piece.count, limit):
                end = min(start + limit, piece.count)
                features, labels = piece.features[start:end], piece.labels[start:end]
                if first:  # straight into the buffer: the common case costs no copy
                    buffer.add_loss(trainer.compute_gradients(features, labels, grads))
                    first = False
                else:
                    if self._scratch is None or type(self._scratch) is not type(grads) or len(self._scratch) != len(grads):
                        self._scratch = buffer.zeros_like_gradients()
                    buffer.add_loss(trainer.compute_gradients(features, labels, self._scratch))
                    grads += self._scratch
            buffer.add_piece(p, piece)
        buffer.add_passes_again(trainer.passes_computed_again - passes_again)

    def _apply(self, r: _Round, gathered: _Gathered) -> bool:
        """Apply the summed step and record it; False when its loss is not finite (the job fails)."""
        host, buffer, progress = self.host, r.buffer, self.host.progress
        total, loss_sum = buffer.samples, buffer.loss_sum
        if not math.isfinite(loss_sum):
            if r.rv.rank == 0:
                host.fail_job(f"loss is {loss_sum} at step {progress.step + 1}; lower the learning rate or check the data")
            return False
        if host.spec.lr_scaling != LrScaling.NONE:
            host.trainer.scale_learning_rate(host.spec.lr_scaling.factor(total, host.spec.full_batch))
        host.trainer.apply_gradients(buffer.gradients, total)
        r.times.mark(Phase.APPLY)
        progress.step += 1
        summaries = gathered.summaries
        progress.lineage = next_lineage(progress.lineage, progress.step,
                                        summaries[0] if len(summaries) == 1 else np.concatenate(summaries))
        host.record_step(r.rv, gathered.ranges, total, loss_sum, buffer.passes_again)
        r.times.mark(Phase.REPORT)
        r.times.steps += 1
        return True
