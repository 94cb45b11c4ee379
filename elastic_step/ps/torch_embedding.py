"""PsEmbedding: a PyTorch embedding whose table lives on the parameter-server shards.

A model definition uses it as it would `nn.Embedding`; the table is not a parameter of the net,
so the dense gradient buffer, the state sharing and the checkpoints never carry it. Each forward
asks its *source* for the rows of the batch's distinct ids:

- on a PS-mode worker the training step binds a source that pulls from the shards
  (worker/ps_step.py); the pulled rows become a leaf tensor whose gradient, after the backward
  pass, is the batch's gradient merged per id, which the step pushes (`take_gradients`);
- in the master, `bind_tables` serves the rows from the live shards while they run (validation),
  and once they have stopped `freeze_tables` gives the model the trained table from their
  snapshots as buffers: the test-set evaluation and the exported models are plain torch;
- with neither (the master's check of the model definition before the shards start), a table's
  initial rows, as a fresh shard would create them.

Only this module of elastic_step.ps imports torch.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import weakref

import numpy as np
import torch
from torch import nn

from elastic_step.ps.api import OptimizerKind, TableSpec
from elastic_step.ps.table import initial_weights

RowSource = Callable[[np.ndarray], np.ndarray]  # distinct int64 ids -> float32 rows (len x dim)

_TABLE_SOURCES: dict[str, RowSource] = {}  # this process's sources by table name (bind_tables)
_FROZEN: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # table name -> (sorted ids, their weights)
_INSTANCES: weakref.WeakSet = weakref.WeakSet()  # every PsEmbedding of this process, for freeze_tables


def bind_tables(sources: dict[str, RowSource]) -> None:
    """Serve every PsEmbedding of these tables, in this process, from `sources` (the master's
    validation, from the running shards)."""
    _TABLE_SOURCES.update(sources)


def freeze_tables(tables: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """Give every PsEmbedding of these tables in this process (and every one made later) the
    trained table itself, (ids, weights), as buffers: the model is then whole, plain torch, for
    the master's evaluation and the exported MLflow and TorchScript models. An id the table does
    not hold (never trained on) gets a zero row."""
    for name, (ids, rows) in tables.items():
        order = np.argsort(ids, kind="stable")
        _FROZEN[name] = (np.ascontiguousarray(ids[order], dtype=np.int64), np.ascontiguousarray(rows[order], dtype=np.float32))
    for module in list(_INSTANCES):
        module._adopt_frozen()


class PsEmbedding(nn.Module):
    def __init__(self, name: str, dim: int, optimizer: str = "adagrad", lr: float = 0.01, seed: int = 0,
                 init_scale: float = 0.05):
        super().__init__()
        self.spec = TableSpec(name, dim, OptimizerKind(optimizer), lr=lr, seed=seed, init_scale=init_scale)
        self.register_buffer("_device", torch.zeros(0), persistent=False)  # follows the net to its device
        # Not in the state dict: the workers' model bytes never hold the table (freeze_tables).
        self.register_buffer("frozen_ids", torch.full((1,), -1, dtype=torch.int64), persistent=False)
        self.register_buffer("frozen_rows", torch.zeros(1, dim), persistent=False)
        self.frozen = False
        self.source: RowSource | None = None  # set by the training step; else the process's binding
        self._pulled: list[tuple[np.ndarray, torch.Tensor]] = []  # (distinct ids, leaf rows) per forward
        _INSTANCES.add(self)
        self._adopt_frozen()

    def _adopt_frozen(self) -> None:
        table = _FROZEN.get(self.spec.name)
        if table is None or not len(table[0]):
            return
        ids, rows = table
        self.frozen_ids = torch.from_numpy(ids).to(self._device.device)
        self.frozen_rows = torch.from_numpy(rows[:, : self.spec.dim]).to(self._device.device)
        self.frozen = True

    def __setstate__(self, state):
        super().__setstate__(state)
        _INSTANCES.add(self)

    def __getstate__(self):  # a saved model keeps the table's spec, not a worker's connection
        state = self.__dict__.copy()
        state["source"], state["_pulled"] = None, []
        return state

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.source is None and self.frozen:
            return self._frozen_lookup(ids)
        flat = ids.reshape(-1).detach().cpu().numpy().astype(np.int64, copy=False)
        unique, inverse = np.unique(flat, return_inverse=True)
        source = self.source or _TABLE_SOURCES.get(self.spec.name)
        training = torch.is_grad_enabled() and self.training
        if source is None and training:
            raise RuntimeError(f"embedding table {self.spec.name!r} lives on parameter-server shards: "
                               "train it with --mode ps")
        if source is None:  # no shards (yet): the rows a fresh table starts with, as a pull would give
            source = partial(initial_weights, self.spec)
        rows = torch.from_numpy(np.ascontiguousarray(source(unique), dtype=np.float32)).to(self._device.device)
        if training:
            rows.requires_grad_(True)
            self._pulled.append((unique, rows))
        index = torch.from_numpy(inverse.reshape(-1)).to(self._device.device)
        return rows[index].reshape(*ids.shape, self.spec.dim)

    def _frozen_lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Plain torch ops only, so that torch.jit.trace and torch.export can follow them."""
        flat = ids.reshape(-1)
        positions = torch.searchsorted(self.frozen_ids, flat).clamp(max=self.frozen_ids.shape[0] - 1)
        held = (self.frozen_ids[positions] == flat).unsqueeze(1).to(self.frozen_rows.dtype)
        return (self.frozen_rows[positions] * held).reshape(*ids.shape, self.spec.dim)

    def take_gradients(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The distinct ids of this batch's forward passes and the summed loss's gradient for each
        (None when no forward ran since the last call), and forget them."""
        pulled, self._pulled = self._pulled, []
        parts = [(ids, rows.grad) for ids, rows in pulled if rows.grad is not None]
        if not parts:
            return None
        ids = np.concatenate([i for i, _ in parts])
        grads = np.concatenate([g.detach().float().cpu().numpy() for _, g in parts])
        return ids, grads  # repeated ids across forwards are summed by the push (client.py)

    def forget(self) -> None:
        self._pulled = []


def ps_tables(net: nn.Module) -> list[PsEmbedding]:
    """The net's PsEmbedding modules, one per table name (a name used twice is one table)."""
    found: dict[str, PsEmbedding] = {}
    for module in net.modules():
        if isinstance(module, PsEmbedding):
            earlier = found.setdefault(module.spec.name, module)
            if earlier.spec != module.spec:
                raise ValueError(f"embedding table {module.spec.name!r} is declared twice with different settings")
    return list(found.values())
