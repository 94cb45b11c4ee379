"""The seam between a worker and its training mode.

The worker (loop.py) registers, rendezvouses, makes the members' states identical, reports
applied steps and hands in checkpoints and the final model: all of that is the same whatever a
step does. A *training step* class (one per TrainingMode, chosen in step_registry.py) trains a
round's steps: where the rows' gradients go and how the update is applied. It reaches the worker
only through `StepHost`.
"""

from __future__ import annotations

import abc
import hashlib
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Callable, Protocol

from elastic_step.protocol import JobSpec, RangeRecord, RendezvousReply, StepRecord
from elastic_step.worker.collective import Collective


class RoundOutcome(StrEnum):
    """How a round ended for this worker."""

    DONE = "done"  # every epoch is applied (rank 0 handed in the model)
    REGROUP = "regroup"  # a peer died, a member joined or left: rendezvous again
    FAILED = "failed"  # the job cannot go on (the loss is not finite): exit


@dataclass
class Progress:
    """What this worker's state has applied. `lineage` is a digest of every step applied (each
    step's counts, summed loss and row ranges, which every rank sees alike): equal lineage at
    equal step, equal state. `unacked`: the records of applied steps the master has not yet
    acknowledged as final (every rank keeps them, so any survivor can report them)."""

    step: int = -1  # -1: this worker holds no synchronised state yet
    lineage: int = 0
    unacked: dict[int, StepRecord] = field(default_factory=dict)


def initial_lineage(kind: str, step: int) -> int:
    """The lineage of a state loaded from the master (a checkpoint or a warm-start model)."""
    digest = hashlib.blake2b(f"{kind}@{step}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little")


class StepHost(Protocol):
    """What a training step may use of its worker."""

    spec: JobSpec
    trainer: object  # the framework's Trainer (frameworks/)
    collective: Collective
    progress: Progress

    def task_taker(self, round_id: int) -> Callable:
        """The round's source of tasks (tasks.TaskFeed.taker)."""

    def regroup_due(self, round_id: int) -> bool:
        """The worker heard of a newer round, or of a stop: the round must end at this step."""

    def flush_reports(self) -> None:
        """Wait until every applied step has been sent to the master (rank 0)."""

    def send_reports(self) -> None:
        """Have every applied step sent to the master soon, without waiting (rank 0)."""

    def record_step(self, rv: RendezvousReply, ranges: list[list[RangeRecord]], samples: int, loss: float,
                    passes_again: int = 0) -> None:
        """Report the step just applied (progress.step): by rank, the ranges it consumed;
        `passes_again`: its float16 passes computed again at a smaller loss scale, over every rank."""

    def fail_job(self, reason: str) -> None:
        """Fail the job with `reason` (rank 0 only: one report is enough)."""

    def finish(self, rv: RendezvousReply) -> RoundOutcome:
        """Every epoch is applied: rank 0 hands in the final model."""


class TrainingStep(abc.ABC):
    """Trains a round's steps for one TrainingMode."""

    def __init__(self, host: StepHost):
        self.host = host

    def buffer_device(self):
        """The torch device the step buffer lives on, or None: host memory (numpy)."""
        return None

    @abc.abstractmethod
    def train_round(self, rv: RendezvousReply) -> RoundOutcome:
        """Train steps from rv.start_step until the round ends for this worker. A collective
        that fails (a peer died or hung) raises RuntimeError, which the worker reports."""
