"""The flat float32 buffer one allreduce sums in each micro-round of a step, behind named views.

    [ gradients | samples, loss sum, passes again, regroup, done | rank 0's ranges | rank 1's ranges | ... ]

Every rank writes only its own part and zeros elsewhere, so the sum hands every rank the summed
gradients, the step's sample count and summed loss, how many float16 passes were computed again at
a smaller loss scale (frameworks/loss_scale.py), the flags (a flag is set when any rank set it)
and every rank's row ranges: which rows each rank consumed travels in the same collective
that applies them. A rank's part is a "may have more rows" flag, then up to MAX_PIECES
(task, offset, count) triples, each integer as two exact float halves.

All the index arithmetic of the layout lives here; the step code speaks in the views' names.

A PyTorch trainer's buffer is a tensor on the trainer's own device (`device`; AllreduceStep picks
it): host memory on the CPU, where gloo's peer links sum the same memory as numpy; GPU memory
when NCCL sums the step on the trainer's GPU. The trainer writes its gradients straight into it,
the collective sums it in place and the optimizer reads the sum there, so on a GPU no gradient
crosses to the host. The part after the gradients, a few hundred bytes of counts, flags and ranges
that the step's code reads and writes on the host, is mirrored in host memory (`meta`): copied in
before each collective and out after it. Other trainers (Keras) get a numpy buffer.
"""

from __future__ import annotations

import numpy as np
import torch

from elastic_step.protocol import RangeRecord
from elastic_step.worker.collective import decode_int, encode_int
from elastic_step.worker.rows import Piece

HEADER = 5  # samples, loss sum, passes computed again, regroup flag, done flag
_SUMMED = 3  # the first of them add up over a step's micro-rounds
MAX_PIECES = 4  # ranges one rank reports per micro-round (a rank with more reports the rest in the next)
_PIECE = 6  # (task, offset, count), two float halves each
PER_RANK = 1 + _PIECE * MAX_PIECES  # "may have more rows", then its pieces


class StepBuffer:
    """One step buffer for `n_gradients` gradient values and a round of `world` ranks, as seen
    by `rank`. The views share the buffer's memory: writing through them writes the buffer.

    `device`: None keeps the buffer in host memory (numpy; the gradients are a numpy view);
    a torch device keeps it there (a tensor; the gradients are a tensor view of it), with the
    part after the gradients mirrored in host memory (module docstring)."""

    def __init__(self, n_gradients: int, world: int, rank: int, device: torch.device | None = None):
        n = n_gradients
        self.world, self.rank = world, rank
        size = n + HEADER + PER_RANK * world
        self.resident: torch.Tensor | None = None  # the whole buffer in device memory, when it lives there
        if device is None:
            self.data = np.zeros(size, dtype=np.float32)  # what the collective sums
            self.gradients = self.data[:n]
            # Everything but the gradients: cleared each micro-round, and the step's summary
            # (counts, flags and ranges, which every rank sees alike) that its lineage digests.
            self.meta = self.data[n:]
        else:
            self.resident = torch.zeros(size, dtype=torch.float32, device=device)
            self.gradients = self.resident[:n]
            # In host memory the tensor's own tail is the mirror (numpy shares its memory); a
            # device's tail is mirrored by a copy each way around the collective.
            on_cpu = self.resident.device.type == "cpu"
            # Pinned: the copy in before each collective does not wait for the step's backward pass.
            self.meta = self.resident[n:].numpy() if on_cpu else torch.zeros(size - n, pin_memory=True).numpy()
        self._samples, self._loss, self._again, self._regroup, self._done = 0, 1, 2, 3, 4  # in `meta`
        self._ranks = HEADER  # rank r's part starts at _ranks + PER_RANK * r

    def sum_over(self, collective) -> None:
        """Sum the whole buffer over every rank of `collective`'s round, in place."""
        if self.resident is None:
            collective.allreduce_sum(self.data)
            return
        if self.resident.device.type == "cpu":
            collective.allreduce_sum(self.resident)
            return
        tail = self.resident[self.gradients.numel():]
        tail.copy_(torch.from_numpy(self.meta), non_blocking=True)
        collective.allreduce_sum(self.resident)
        self.meta[:] = tail.cpu().numpy()

    def held_sums(self) -> tuple:
        """A copy of what a step's micro-rounds add up (gradients, samples, loss, passes computed
        again), for add_sums."""
        grads = self.gradients.clone() if self.resident is not None else self.gradients.copy()
        return grads, self.meta[:_SUMMED].copy()

    def add_sums(self, held: tuple) -> None:
        """Add an earlier micro-round's held_sums() to this one's."""
        grads, counts = held
        self.gradients += grads
        self.meta[:_SUMMED] += counts

    def zeros_like_gradients(self):
        """A second gradient buffer where this one's gradients live (host or device)."""
        if self.resident is not None:
            return torch.zeros_like(self.gradients)
        return np.zeros(self.gradients.size, dtype=np.float32)

    # -- before the collective: this rank's part -------------------------------------------------
    def clear_meta(self) -> None:
        """Zero all but the gradients (which compute_gradients writes whole, or zero_gradients
        clears: zeroing them every micro-round too would cost a memset of the model's size)."""
        self.meta[:] = 0.0

    def zero_gradients(self) -> None:
        self.gradients[:] = 0.0

    def add_loss(self, loss: float) -> None:
        self.meta[self._loss] += loss

    def add_passes_again(self, passes: int) -> None:
        self.meta[self._again] += passes

    def add_piece(self, index: int, piece: Piece) -> None:
        """This rank's `index`-th piece of the micro-round: its rows count, and its range."""
        self.meta[self._samples] += piece.count
        slot = self._ranks + PER_RANK * self.rank + 1 + _PIECE * index
        for i, value in enumerate((piece.task_id, piece.offset, piece.count)):
            self.meta[slot + 2 * i], self.meta[slot + 2 * i + 1] = encode_int(value)

    def set_flags(self, regroup: bool, done: bool, may_have_more: bool) -> None:
        if may_have_more:
            self.meta[self._ranks + PER_RANK * self.rank] = 1.0
        self.meta[self._regroup] = 1.0 if regroup else 0.0
        self.meta[self._done] = 1.0 if done else 0.0

    # -- after the collective: every rank's word ---------------------------------------------------
    @property
    def samples(self) -> int:
        return int(round(self.meta[self._samples]))

    @property
    def loss_sum(self) -> float:
        return float(self.meta[self._loss])

    @property
    def passes_again(self) -> int:
        """float16 passes computed again at a smaller loss scale, over every rank."""
        return int(round(self.meta[self._again]))

    @property
    def regroup(self) -> bool:
        """Some rank heard of a new round (or a stop, or its round ended): every rank stops here."""
        return bool(self.meta[self._regroup] > 0)

    @property
    def done(self) -> bool:
        """The master told some rank that every epoch is applied."""
        return bool(self.meta[self._done] > 0)

    def may_have_more(self, rank: int) -> bool:
        return bool(self.meta[self._ranks + PER_RANK * rank] > 0)

    def ranges_of(self, rank: int) -> list[RangeRecord]:
        """The ranges `rank` consumed in this micro-round, in order (its pieces fill its slots
        from the first; a count of 0 ends them)."""
        data, first = self.meta, self._ranks + PER_RANK * rank + 1
        ranges = []
        for base in range(first, first + _PIECE * MAX_PIECES, _PIECE):
            count = decode_int(data[base + 4], data[base + 5])
            if count == 0:
                break
            # Built unvalidated: these are exact non-negative integers, decoded on every step; the
            # master validates the step record that carries them.
            ranges.append(RangeRecord.model_construct(task_id=decode_int(data[base], data[base + 1]),
                                                      offset=decode_int(data[base + 2], data[base + 3]), count=count))
        return ranges

    def summary(self) -> np.ndarray:
        """A copy of this micro-round's counts, flags and ranges."""
        return self.meta.copy()
