"""The allreduce step's buffer: what each rank writes into its part, summed over ranks as the
collective sums it, tells every rank the step's totals, flags and every rank's row ranges
exactly, whether it lives in host memory (numpy) or on a trainer's device (a tensor, with its
counts, flags and ranges mirrored on the host); every training mode a job spec can name has a step class on the worker; and rank 0
hands its applied steps to the reporter in batches, in order."""

import numpy as np
import pytest
import torch

from elastic_step.protocol import RangeRecord, TrainingMode
from elastic_step.worker.rows import Piece
from elastic_step.worker.handover import StepHandOver
from elastic_step.worker.step_buffer import MAX_PIECES, StepBuffer
from elastic_step.worker.step_registry import STEP_CLASSES

N_GRAD = 5
# Host memory, and a tensor on a device (the CPU here; a GPU's memory under NCCL).
PLACES = [None, torch.device("cpu")]


def rank_buffer(rank: int, world: int, pieces: list[tuple[int, int, int]], regroup=False, done=False, more=False,
                device=None, passes_again: int = 0) -> StepBuffer:
    buffer = StepBuffer(N_GRAD, world, rank, device)
    buffer.clear_meta()
    buffer.gradients[:] = rank + 1
    buffer.add_passes_again(passes_again)
    for i, (task, offset, count) in enumerate(pieces):
        buffer.add_loss(0.5 * count)
        buffer.add_piece(i, Piece(task, offset, count, None, None))
    buffer.set_flags(regroup=regroup, done=done, may_have_more=more)
    return buffer


class SummedAlready:
    """A collective whose sum is known: it writes `total` into the buffer it is given."""

    def __init__(self, total: np.ndarray):
        self.total = total

    def allreduce_sum(self, buffer) -> None:
        buffer[:] = torch.from_numpy(self.total) if isinstance(buffer, torch.Tensor) else self.total


def whole(buffer: StepBuffer) -> np.ndarray:
    """What the collective sums of a rank's buffer: its gradients, then its counts, flags and ranges."""
    if buffer.resident is None:
        return buffer.data.copy()
    return np.concatenate([buffer.gradients.numpy(), buffer.meta])


def summed(buffers: list[StepBuffer]) -> None:
    """What the collective does: every rank ends with the sum of every rank's buffer."""
    total = np.sum([whole(b) for b in buffers], axis=0)
    for b in buffers:
        b.sum_over(SummedAlready(total))


@pytest.mark.parametrize("device", PLACES, ids=["host", "device"])
def test_every_rank_reads_the_totals_flags_and_every_ranks_ranges_after_the_sum(device):
    big = 2**40 + 12345  # ids and offsets beyond float32's exact integers travel exactly
    parts = {0: [(7, 0, 16)], 1: [(big, big - 1, 3), (9, 0, 13)], 2: []}
    buffers = [rank_buffer(0, 3, parts[0], more=True, device=device),
               rank_buffer(1, 3, parts[1], regroup=True, device=device, passes_again=2),
               rank_buffer(2, 3, parts[2], device=device, passes_again=1)]
    buffers[2].zero_gradients()
    summed(buffers)
    for b in buffers:
        assert b.samples == 32 and b.loss_sum == 16.0
        assert b.passes_again == 3  # float16's overflows, every rank's
        assert b.regroup and not b.done
        assert [b.may_have_more(r) for r in range(3)] == [True, False, False]
        assert b.ranges_of(0) == [RangeRecord(task_id=7, offset=0, count=16)]
        assert b.ranges_of(1) == [RangeRecord(task_id=big, offset=big - 1, count=3), RangeRecord(task_id=9, offset=0, count=13)]
        assert b.ranges_of(2) == []
        assert list(b.gradients) == [3.0] * N_GRAD


@pytest.mark.parametrize("device", PLACES, ids=["host", "device"])
def test_a_rank_reports_up_to_max_pieces_ranges_and_a_cleared_buffer_says_nothing(device):
    pieces = [(task, 0, 1) for task in range(MAX_PIECES)]
    buffer = rank_buffer(1, 2, pieces, done=True, device=device)
    assert len(buffer.ranges_of(1)) == MAX_PIECES and buffer.done and buffer.samples == MAX_PIECES
    summary = buffer.summary()
    buffer.clear_meta()
    assert buffer.samples == 0 and not buffer.done and not buffer.regroup and buffer.ranges_of(1) == []
    assert list(buffer.gradients) == [2.0] * N_GRAD  # the gradients are the step's to overwrite, not cleared
    assert summary.any()  # the summary was a copy


@pytest.mark.parametrize("device", PLACES, ids=["host", "device"])
def test_held_sums_carry_gradients_samples_and_loss_across_micro_rounds(device):
    buffer = rank_buffer(0, 1, [(1, 0, 4)], device=device, passes_again=1)
    first = buffer.held_sums()
    buffer.clear_meta()
    buffer.gradients[:] = 10.0
    buffer.add_loss(1.0)
    buffer.add_passes_again(2)
    buffer.add_piece(0, Piece(1, 4, 2, None, None))
    buffer.set_flags(regroup=True, done=False, may_have_more=False)
    buffer.add_sums(first)
    assert buffer.samples == 6 and buffer.loss_sum == 3.0 and buffer.passes_again == 3
    assert buffer.regroup and not buffer.done  # flags are the micro-round's own, not summed
    assert list(buffer.gradients) == [11.0] * N_GRAD  # held, not a view the next micro-round overwrote
    assert buffer.ranges_of(0) == [RangeRecord(task_id=1, offset=4, count=2)]  # ranges are per micro-round


def test_a_device_buffer_sums_in_place_and_mirrors_only_its_counts_flags_and_ranges_on_the_host():
    buffer = rank_buffer(0, 2, [(3, 0, 8)], device=torch.device("cpu"))
    grads_at = buffer.gradients.data_ptr()
    assert isinstance(buffer.gradients, torch.Tensor) and buffer.gradients.data_ptr() == buffer.resident.data_ptr()
    assert buffer.meta.size == buffer.resident.numel() - N_GRAD  # no host copy of the gradients
    peer = rank_buffer(1, 2, [(4, 0, 2)], device=torch.device("cpu"))
    summed([buffer, peer])
    assert buffer.gradients.data_ptr() == grads_at and list(buffer.gradients) == [3.0] * N_GRAD
    assert buffer.samples == 10 and buffer.ranges_of(1) == [RangeRecord(task_id=4, offset=0, count=2)]


@pytest.mark.parametrize("mode", list(TrainingMode))
def test_every_training_mode_has_a_step_class(mode):
    assert mode in STEP_CLASSES


def test_rank_0_hands_its_steps_to_the_reporter_in_batches_in_order_and_at_once_when_asked():
    pushed, clock = [], [0.0]
    handover = StepHandOver(lambda round_id, record: pushed.append((round_id, record)), every_s=0.2, clock=lambda: clock[0])
    for step in (1, 2):  # a round's first two steps go at once: the master sees the recovery, and the first is final
        handover.add(4, step)
        assert pushed[-1] == (4, step) and handover.held == 0
    for step in (3, 4, 5):
        clock[0] += 0.05
        handover.add(4, step)
    assert pushed[2:] == [] and handover.held == 3  # not yet due: no wake-up of the reporter per step
    clock[0] += 0.1
    handover.add(4, 6)  # 0.25 s since the last hand-over: all four go, in order
    assert pushed[2:] == [(4, 3), (4, 4), (4, 5), (4, 6)] and handover.held == 0
    handover.add(4, 7, now=True)  # a checkpoint's step goes at once, with whatever was held
    handover.add(4, 8)
    handover.hand_over()  # a step with no rows, a flush or the round's end
    assert pushed[6:] == [(4, 7), (4, 8)] and handover.held == 0
    handover.add(5, 9)  # the next round's first step: at once again
    assert pushed[8:] == [(5, 9)]
