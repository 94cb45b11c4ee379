"""PsEmbedding: a PyTorch embedding whose table lives on the parameter-server shards.

A model definition uses it as it would `nn.Embedding`; the table is not a parameter of the net,
so the dense gradient buffer, the state sharing and the checkpoints never carry it. Where its
rows come from, the batch's distinct ids and the gradients merged per id are embedding.py's
(shared with the Keras layer, keras_embedding.py); this module adds torch's side:

- on a PS-mode worker the pulled rows become a leaf tensor whose gradient, after the backward
  pass, is the batch's gradient merged per id, which the training step pushes (`take_gradients`);
- once the tables are frozen (embedding.freeze_tables), the model holds the trained table as
  buffers and looks ids up with plain torch ops: the test-set evaluation and the exported
  models (TorchScript included) are plain torch.

Only this module of elastic_step.ps imports torch.
"""

from __future__ import annotations

import math
import weakref

import numpy as np
import torch
from torch import nn

from elastic_step.ps.api import OptimizerKind, TableSpec
from elastic_step.ps.embedding import (RowSource, TableRows, bind_tables, freeze_tables, frozen_table, held_or_placeholder,
                                       on_freeze)
from elastic_step.ps.embedding import ps_tables as _ps_tables

__all__ = ["PsEmbedding", "PsWeight", "bind_tables", "freeze_tables", "ps_tables"]

_INSTANCES: weakref.WeakSet = weakref.WeakSet()  # every PsEmbedding of this process, for freeze_tables


def _adopt_all() -> None:
    for module in list(_INSTANCES):
        module._adopt_frozen()


on_freeze(_adopt_all)


class PsEmbedding(nn.Module):
    def __init__(self, name: str, dim: int, optimizer: str = "adagrad", lr: float = 0.01, seed: int = 0,
                 init_scale: float = 0.05, rows: int = 0):
        """`rows`: the table's size, as nn.Embedding's num_embeddings (ids in [0, rows)): the shards
        reserve it up front and the job is refused before it starts if it would not fit them.
        0: undeclared, for ids of any int64 value (raw hashes); the shards grow as ids come."""
        super().__init__()
        self.ps_table = TableRows(TableSpec(name, dim, OptimizerKind(optimizer), lr=lr, seed=seed, init_scale=init_scale,
                                            rows=rows))
        self.register_buffer("_device", torch.zeros(0), persistent=False)  # follows the net to its device
        # Not in the state dict: the workers' model bytes never hold the table (freeze_tables).
        self.register_buffer("frozen_ids", torch.full((1,), -1, dtype=torch.int64), persistent=False)
        self.register_buffer("frozen_rows", torch.zeros(1, dim), persistent=False)
        self.frozen = False
        _INSTANCES.add(self)
        self._adopt_frozen()

    @property
    def spec(self) -> TableSpec:
        return self.ps_table.spec

    @property
    def source(self) -> RowSource | None:
        return self.ps_table.source

    @source.setter
    def source(self, source: RowSource | None) -> None:
        self.ps_table.source = source

    def _adopt_frozen(self) -> None:
        table = frozen_table(self.spec.name)
        if table is not None:
            self.hold_table(*table)

    def hold_table(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Look ids up in this trained table from now on (embedding.hold_tables); it is kept as the
        module's buffers, so a pickled or TorchScript copy of the net holds it too."""
        ids, rows = held_or_placeholder(*self.ps_table.hold(ids, rows))
        self.frozen_ids = torch.from_numpy(ids).to(self._device.device)
        self.frozen_rows = torch.from_numpy(rows).to(self._device.device)
        self.frozen = True

    def __setstate__(self, state):
        super().__setstate__(state)
        _INSTANCES.add(self)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.source is None and self.frozen:
            return self._frozen_lookup(ids)
        training = torch.is_grad_enabled() and self.training
        unique, inverse, pulled = self.ps_table.distinct(ids.detach().cpu().numpy(), training)
        rows = torch.from_numpy(pulled).to(self._device.device)
        if training:
            rows.requires_grad_(True)
            self.ps_table.note(unique, lambda: None if rows.grad is None else rows.grad.detach().float().cpu().numpy())
        index = torch.from_numpy(inverse).to(self._device.device)
        # index_select: the same rows and (summed per id) gradient as rows[index], whose backward
        # (an accumulating index_put) costs more
        return torch.index_select(rows, 0, index).reshape(*ids.shape, self.spec.dim)

    def _frozen_lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Plain torch ops only, so that torch.jit.trace and torch.export can follow them."""
        flat = ids.reshape(-1)
        positions = torch.searchsorted(self.frozen_ids, flat).clamp(max=self.frozen_ids.shape[0] - 1)
        held = (self.frozen_ids[positions] == flat).unsqueeze(1).to(self.frozen_rows.dtype)
        return (self.frozen_rows[positions] * held).reshape(*ids.shape, self.spec.dim)

    def take_gradients(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The distinct ids of this batch's forward passes and the summed loss's gradient for each
        (None when no forward ran since the last call), and forget them."""
        return self.ps_table.take_gradients()

    def forget(self) -> None:
        self.ps_table.forget()


class PsWeight(nn.Module):
    """A dense weight (rows x cols) on the parameter-server shards instead of the workers'
    allreduce, where a model chooses: a weight too large to sum every step, or one it wants
    updated by the shards' optimizer. It is a table of `rows` rows whose ids are the row indices,
    so it has what a table has (exactly-once pushes, the ledger, snapshots, moves, checkpoint
    cuts, export); each training forward pulls the whole weight, as every batch uses every row.

        self.weight = PsWeight("wide_out", 10, 4096)  # as nn.Linear(4096, 10)'s weight
        ...
        return x @ self.weight().T
    """

    def __init__(self, name: str, rows: int, cols: int, optimizer: str = "adagrad", lr: float = 0.01, seed: int = 0,
                 init_scale: float | None = None):
        super().__init__()
        # nn.Linear's default bound, 1/sqrt(fan_in), unless the model says otherwise
        scale = 1.0 / math.sqrt(cols) if init_scale is None else init_scale
        self.table = PsEmbedding(name, cols, optimizer, lr=lr, seed=seed, init_scale=scale, rows=rows)
        self.register_buffer("row_ids", torch.arange(rows), persistent=False)

    def forward(self) -> torch.Tensor:
        return self.table(self.row_ids)


def ps_tables(net: nn.Module) -> list[PsEmbedding]:
    """The net's PsEmbedding modules, one per table name (a name used twice is one table)."""
    return _ps_tables(net)
