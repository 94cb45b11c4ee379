"""What an embedding whose table lives on the parameter-server shards does, whatever the front end:
PyTorch's PsEmbedding (torch_embedding.py) and Keras' (keras_embedding.py) each hold one
`TableRows` and add only their framework's tensors and autodiff around it. numpy only (and pandas' factorize).

Where a table's rows come from, for a forward pass:
- on a PS-mode worker the training step sets `source`: a pull from the shards (worker/ps_step.py);
- in the master, `bind_tables` serves the rows from the live shards while they run (validation),
  and once they have stopped `freeze_tables` hands the trained table, from their snapshots, to
  every model of the process (the test-set evaluation and the logged model);
- a model given a trained table (`hold_tables`: the release steps', from the training run's
  `ps_tables.npz` beside its weights file, `write_tables`) looks it up itself; the front end
  keeps it with the model (torch buffers, a Keras layer's saved variables), so the logged and
  exported models predict with it in any process;
- a table too big to hold whole is looked up in the shards' final snapshots (shard_tables.py):
  bound in the master (`bind_tables`), a model's own source in the release steps (`read_rows_from`);
- with neither (the master's check of the model definition before the shards start), a table's
  initial rows, as a fresh shard would create them.

A training forward pulls each distinct id of the batch once; the front end notes, per forward,
those ids and (after the backward pass) the summed loss's gradient for each, and the training
step pushes them (`take_gradients`).
"""

from __future__ import annotations

import os
from functools import partial
from typing import Callable

import numpy as np
import pandas

from elastic_step.ps.api import TableSpec
from elastic_step.ps.table import initial_weights

TABLES_FILE = "ps_tables.npz"  # the trained tables, beside the final model's weights file
Table = tuple[np.ndarray, np.ndarray]  # (ids sorted ascending, their rows: len x dim float32)
RowSource = Callable[[np.ndarray], np.ndarray]  # distinct int64 ids -> float32 rows (len x dim)
Gradient = np.ndarray | Callable[[], "np.ndarray | None"]  # an array, or one read after the backward pass

_TABLE_SOURCES: dict[str, RowSource] = {}  # this process's sources by table name (bind_tables)
_FROZEN: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # table name -> (sorted ids, their rows)
_ON_FREEZE: list[Callable[[], None]] = []  # each front end's hook: its live embeddings adopt the frozen tables


def bind_tables(sources: dict[str, RowSource]) -> None:
    """Serve every embedding of these tables, in this process, from `sources` (the master's
    validation, from the running shards)."""
    _TABLE_SOURCES.update(sources)


def freeze_tables(tables: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """Give every embedding of these tables in this process (and every one made later) the
    trained table itself, (ids, rows): the model is then whole, for the master's evaluation and
    the exported models. An id the table does not hold (never trained on) gets a zero row."""
    for name, (ids, rows) in tables.items():
        _FROZEN[name] = sorted_table(ids, rows)
    for hook in _ON_FREEZE:
        hook()


def on_freeze(hook: Callable[[], None]) -> None:
    _ON_FREEZE.append(hook)


def sorted_table(ids: np.ndarray, rows: np.ndarray) -> Table:
    """The table by ascending id, as lookups search it; one already so (a frozen table) is not copied."""
    ids, rows = np.asarray(ids, dtype=np.int64), np.asarray(rows, dtype=np.float32)
    if len(ids) > 1 and (ids[1:] < ids[:-1]).any():
        order = np.argsort(ids, kind="stable")
        ids, rows = ids[order], rows[order]
    return np.ascontiguousarray(ids), np.ascontiguousarray(rows)


def held_or_placeholder(ids: np.ndarray, rows: np.ndarray) -> Table:
    """A held table as a front end's tensors keep it: an empty one as the id -1 (no id's) and a
    zero row, so that a lookup (searchsorted, then gather) has a row to land on."""
    if len(ids):
        return ids, rows
    return np.full(1, -1, np.int64), np.zeros((1, rows.shape[1]), np.float32)


def frozen_table(name: str) -> tuple[np.ndarray, np.ndarray] | None:
    table = _FROZEN.get(name)
    return table if table is not None and len(table[0]) else None


class TableRows:
    """One table as a model sees it: the rows of a batch's distinct ids, and their gradients."""

    def __init__(self, spec: TableSpec):
        self.spec = spec
        self.source: RowSource | None = None  # set by the training step; else the process's binding
        self.held: Table | None = None  # the trained table this model was given (hold), looked up first
        self._pulled: list[tuple[np.ndarray, Gradient]] = []  # (distinct ids, their gradient) per forward

    def __getstate__(self):  # a saved model keeps the table's spec, not a worker's connection (its front end keeps the table)
        return {"spec": self.spec, "source": None, "held": None, "_pulled": []}

    def hold(self, ids: np.ndarray, rows: np.ndarray) -> Table:
        """Look ids up in this trained table from now on (its rows cut to the table's dim); returns it sorted."""
        self.held = sorted_table(np.asarray(ids), np.asarray(rows)[:, : self.spec.dim])
        return self.held

    def distinct(self, ids: np.ndarray, training: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(distinct ids, each id's index among them, their rows) for a batch's ids, pulled once each."""
        flat = np.asarray(ids).reshape(-1).astype(np.int64, copy=False)
        # A hash table's factorize, not np.unique's sort: about twice as fast on a batch's ids,
        # which come out in order of first appearance (a pull and its push keep that order).
        inverse, unique = pandas.factorize(flat)
        source = self.source
        if source is None:  # the trained table once held (the shards stopped), else the master's live shards
            source = self.frozen_rows if self._table() is not None else _TABLE_SOURCES.get(self.spec.name)
        if source is None and training:
            raise RuntimeError(f"embedding table {self.spec.name!r} lives on parameter-server shards: "
                               "train it with --mode ps")
        if training or source is None:  # not when serving: an id the table never held gets a zero row there
            self._check_range(unique)
        if source is None:  # no shards (yet): the rows a fresh table starts with, as a pull would give
            source = partial(initial_weights, self.spec)
        rows = np.ascontiguousarray(source(unique), dtype=np.float32)
        return unique, inverse.reshape(-1), rows

    def _check_range(self, unique: np.ndarray) -> None:
        """A declared table's ids are in [0, rows): one outside is a feed or vocabulary that does
        not match the table, refused here (the master's check of the model definition runs a
        batch through it, so a mismatch fails before any process starts)."""
        rows = self.spec.rows
        if rows and len(unique) and (unique.min() < 0 or unique.max() >= rows):
            bad = unique.min() if unique.min() < 0 else unique.max()
            raise ValueError(f"embedding table {self.spec.name!r} declares {rows:,} rows (ids 0 to {rows - 1:,}) but was "
                             f"given id {bad:,}: declare rows= as the number of ids the feed makes (e.g. "
                             "SparseFeatures.num_ids), or 0 for ids of any value")

    def _table(self) -> Table | None:
        return self.held if self.held is not None else frozen_table(self.spec.name)

    def frozen_rows(self, ids: np.ndarray) -> np.ndarray | None:
        """The trained table's rows of `ids` (zeros for an id it does not hold); None when it has none."""
        table = self._table()
        if table is None:
            return None
        held_ids, held_rows = table
        flat = np.asarray(ids).reshape(-1).astype(np.int64, copy=False)
        if not len(held_ids):  # a table no push reached: every row is zeros
            return np.zeros((*np.shape(ids), self.spec.dim), np.float32)
        positions = np.minimum(np.searchsorted(held_ids, flat), len(held_ids) - 1)
        rows = held_rows[positions, : self.spec.dim] * (held_ids[positions] == flat)[:, None]
        return rows.reshape(*np.shape(ids), self.spec.dim).astype(np.float32, copy=False)

    def note(self, ids: np.ndarray, gradient: Gradient) -> None:
        """A training forward pulled `ids`; `gradient` is (or gives, after the backward pass) theirs."""
        self._pulled.append((ids, gradient))

    def take_gradients(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The distinct ids of this batch's forward passes and the summed loss's gradient for each
        (None when no forward ran since the last call), and forget them."""
        pulled, self._pulled = self._pulled, []
        parts = [(ids, gradient() if callable(gradient) else gradient) for ids, gradient in pulled]
        parts = [(ids, np.asarray(g, dtype=np.float32)) for ids, g in parts if g is not None]
        if not parts:
            return None
        # repeated ids across forwards are summed by the push (client.py)
        return np.concatenate([i for i, _ in parts]), np.concatenate([g for _, g in parts])

    def forget(self) -> None:
        self._pulled = []


def embeddings(model) -> list:
    """Every embedding of the model on the shards (each has a `ps_table`: its TableRows): a
    torch.nn.Module's modules or a Keras model's layers, nested ones included."""
    if hasattr(model, "modules"):  # PyTorch
        parts = model.modules()
    elif hasattr(model, "_flatten_layers"):  # Keras
        parts = model._flatten_layers(include_self=True, recursive=True)
    else:
        parts = []
    return [part for part in parts if isinstance(getattr(part, "ps_table", None), TableRows)]


def ps_tables(model) -> list:
    """The model's embeddings, one per table name (a name used twice is one table)."""
    found: dict[str, object] = {}
    for part in embeddings(model):
        earlier = found.setdefault(part.ps_table.spec.name, part)
        if earlier.ps_table.spec != part.ps_table.spec:
            raise ValueError(f"embedding table {part.ps_table.spec.name!r} is declared twice with different settings")
    return list(found.values())


def held_tables(model) -> dict[str, Table]:
    """The trained tables a model's embeddings hold (after freeze_tables or hold_tables), by name."""
    return {part.ps_table.spec.name: part.ps_table.held for part in ps_tables(model) if part.ps_table.held is not None}


def hold_tables(model, tables: dict[str, Table]) -> None:
    """Give this model's embeddings (only this model's) their trained tables: the front end's
    `hold_table` keeps each with the model, so its logged or exported form holds it too."""
    for part in embeddings(model):
        table = tables.get(part.ps_table.spec.name)
        if table is not None:
            part.hold_table(*table)


def read_rows_from(model, sources: dict[str, RowSource]) -> None:
    """This model's embeddings (only this model's) take their rows from `sources`, by table name:
    a table served from the shards' snapshots (shard_tables.py), too big to hold whole."""
    for part in embeddings(model):
        source = sources.get(part.ps_table.spec.name)
        if source is not None:
            part.ps_table.source = source


def trainer_network(trainer):
    """The framework's model a Trainer trains: TorchTrainer's `net`, KerasTrainer's `model`."""
    network = getattr(trainer, "net", None)
    return getattr(trainer, "model", None) if network is None else network


def write_tables(path: str, tables: dict[str, Table]) -> None:
    """The tables as one `.npz` (names, then each table's ids and rows; no pickled object), replaced whole."""
    arrays = {"names": np.array(list(tables), dtype=np.str_)}
    for i, (ids, rows) in enumerate(tables.values()):
        arrays[f"ids_{i}"], arrays[f"rows_{i}"] = np.asarray(ids, np.int64), np.asarray(rows, np.float32)
    partial_path = f"{path}.partial"
    with open(partial_path, "wb") as f:
        np.savez(f, **arrays)
    os.replace(partial_path, path)


def read_tables(path: str) -> dict[str, Table]:
    """What write_tables wrote, read with allow_pickle=False; ValueError for anything else."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            names = [str(name) for name in archive["names"]]
            tables = {name: (archive[f"ids_{i}"], archive[f"rows_{i}"]) for i, name in enumerate(names)}
    except Exception as exc:
        raise ValueError(f"{os.path.basename(path)} is not a table file written by elastic-step: "
                         f"{type(exc).__name__}: {str(exc)[:200]}") from None
    for name, (ids, rows) in tables.items():
        if ids.dtype != np.int64 or rows.dtype != np.float32 or ids.ndim != 1 or rows.ndim != 2 or len(ids) != len(rows):
            raise ValueError(f"{os.path.basename(path)}: table {name!r} is not int64 ids with one float32 row each")
    return tables
