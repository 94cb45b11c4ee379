"""Where the group goes on from when no worker holds its model: a restore point.

A restore point is the master's newest committed checkpoint (its step, rank 0's state and the
ledger as of that step), or the job's start (the warm-start model, or none: a fresh model) while
no checkpoint has been taken yet. One code path continues from it, both when a master starts
with --resume (or a retried step resumes) and when, in a running master, every worker holding
the model has died: the dispatcher goes back to the point's ledger (rows applied after it return
to todo), the ledger continues from its step (the audit file says so: lines of later steps are
void), and the first round's state source loads the point's state. Exactly once holds because
the model state goes back with the ledger."""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic_step.master.dispatcher import Dispatcher
from elastic_step.master.ledger import Ledger


@dataclass
class InitialState:
    """Where the first round's state comes from when no worker holds one: a checkpoint
    (resume) or a model's parameters (warm start)."""

    kind: str  # "checkpoint" | "model"
    data: bytes
    step: int


@dataclass(frozen=True)
class RestorePoint:
    """A step the group can go back to, with everything needed to continue exactly from it."""

    step: int
    initial: InitialState | None  # what the state source loads; None: a fresh model (seeded as every worker's)
    ledger: dict | None = None  # the dispatcher's snapshot as of `step`; None: the job's start
    rows_final: int = 0  # rows the ledger had finalized through `step` (what the audit then holds from this master)
    worker_rows: dict = field(default_factory=dict)  # each worker's share of them (what status shows per worker)


@dataclass
class Rollback:
    """A mode ps job going back to its newest checkpoint while it runs (master/ps_rollback.py): a
    shard lost its rows, so every shard goes back to the checkpoint's cut, then the group. No
    round settles until the shards hold the cut (`point` set); the first that settles then goes
    on from `point` as from a restore point."""

    cause: str  # what the RESTORED event says happened
    point: RestorePoint | None = None  # set once every shard holds the point's cut again


def restart_from(point: RestorePoint, dispatcher: Dispatcher, ledger: Ledger) -> None:
    """Make the dispatcher and the ledger continue after `point`."""
    if point.ledger is not None:
        dispatcher.restore(point.ledger)
    else:
        dispatcher.start_over()
    ledger.resume_from(point.step, point.rows_final, point.worker_rows)
