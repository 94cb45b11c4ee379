"""The parameter-server package's vocabulary: table specs, optimizers, reply statuses, errors.

A *shard* is one server process holding, for every table, the rows of the virtual shards it
owns (routing.py). Workers pull rows and push gradients merged per id through client.py; every
push carries (task, batch_seq, attempt) so that a shard applies each batch of each table once,
however often it is re-sent (shard.py).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from enum import StrEnum


class OptimizerKind(StrEnum):
    """The per-row optimizer a table applies on its shard (optimizers.py)."""

    SGD = "sgd"  # w -= lr * g; no slots
    ADAGRAD = "adagrad"  # one slot: the sum of squared gradients (torch.optim.Adagrad's rule)
    ADAM = "adam"  # two slots (m, v); the bias correction counts this row's own updates (lazy Adam)


SLOTS = {OptimizerKind.SGD: 0, OptimizerKind.ADAGRAD: 1, OptimizerKind.ADAM: 2}

_TABLE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class TableSpec:
    """One embedding table. `seed` with a row's id fixes the row's initial values, so any shard
    (a relaunched one, or the new owner of a moved virtual shard) creates the same row."""

    name: str
    dim: int
    optimizer: OptimizerKind = OptimizerKind.ADAGRAD
    lr: float = 0.01
    seed: int = 0
    init_scale: float = 0.05  # rows start uniform in [-init_scale, init_scale] (Keras' Embedding default)
    initial_accumulator: float = 0.0  # Adagrad's starting slot value (torch's default)
    eps: float = 1e-10  # Adagrad: torch's 1e-10; set 1e-8 for Adam as torch does
    beta1: float = 0.9
    beta2: float = 0.999
    # The table's declared size, as nn.Embedding's num_embeddings: its ids are in [0, rows), and
    # each shard reserves its share of them up front. 0: undeclared (any int64 id, e.g. a raw
    # hash), and a shard's table grows as ids arrive.
    rows: int = 0

    def __post_init__(self):
        if not _TABLE_NAME.match(self.name):
            raise ValueError(f"table name {self.name!r}: use 1-64 letters, digits, '_', '.' or '-'")
        if self.dim < 1 or self.dim > 4096:
            raise ValueError(f"table {self.name}: dim {self.dim} must be between 1 and 4096")
        object.__setattr__(self, "optimizer", OptimizerKind(self.optimizer))
        if not self.lr > 0:
            raise ValueError(f"table {self.name}: lr {self.lr} must be positive")
        if self.rows < 0:
            raise ValueError(f"table {self.name}: rows {self.rows} must be 0 (undeclared) or the number of ids")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> TableSpec:
        return cls(**data)


class Status(StrEnum):
    """A shard's answer to one request (the reply header's `status`)."""

    OK = "ok"
    STALE_EPOCH = "stale_epoch"  # the request's routing epoch is not the shard's: refresh routes, retry
    WRONG_SHARD = "wrong_shard"  # an id's virtual shard is not this shard's: refresh routes, retry
    MOVING = "moving"  # an id's virtual shard is on its way to this shard (scale --ps): retry shortly
    UNAUTHORIZED = "unauthorized"  # missing or wrong job token: not retried
    BAD_REQUEST = "bad_request"  # a malformed request (unknown table, wrong sizes): not retried
    NO_CUT = "no_cut"  # no cut of the checkpoint's step can be had (ps/cuts.py): that checkpoint fails
    FENCED = "fenced"  # a push of a round the job rolled back past (a rollback's fence): not retried, the round is over


RETRY_AFTER_REFRESH = frozenset({Status.STALE_EPOCH, Status.WRONG_SHARD, Status.MOVING})


class PsError(RuntimeError):
    """A parameter-server request that cannot succeed by retrying."""


class ShardsNotStarted(PsError):
    """A resize's added shards did not start: they were ended, and nothing moved."""


class ShardUnavailable(PsError):
    """A shard did not answer within the client's retry deadline."""


class ShardsStopped(ShardUnavailable):
    """The job's shards stopped (its end) while the master still pulled from them."""


class RoundFenced(RuntimeError):
    """A push refused because the job rolled back to a checkpoint after its round began (the
    shards' fence). Not a PsError, which fails the job: the worker takes it as the end of its
    round, as a failed collective, and rendezvouses again (worker/loop.py)."""
