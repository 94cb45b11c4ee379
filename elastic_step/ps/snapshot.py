"""A shard's snapshot: every table's rows, counters, id index and applied pushes, in one file.

Format: the line `ESS1`, one line of JSON naming the arrays in order, then each array in NumPy's
.npy format (numpy.lib.format), read back with allow_pickle=False: nothing in it is ever
unpickled. Not .npz: a zip member is read and written through Python's CRC-32 in small chunks,
which made a 2.5M-row snapshot take ~2 s each way; .npy arrays go straight to and from the file.

Arrays per table: `<table>.ids` (int64), `<table>.rows` (float32, weights and optimizer slots),
`<table>.updates` (uint32), `<table>.index` (int32: a hash id index, so that loading does not
rebuild it; empty for a table indexed directly, which is rebuilt with one scatter), and the pushes this shard has applied (applied.py): `<table>.applied_below`
(k x 2 int64: task, watermark) and `<table>.applied_above` (k x 2 int64: task, batch_seq), and
for each group of virtual shards moved in with keys of their own `<table>.applied_gI.mask`
(bool, one per virtual shard), `.applied_gI.below` and `.applied_gI.above`.

`mapped` opens a snapshot's tables memory-mapped, read-only (a served model whose tables are the
shards' snapshots: release/sharded_model.py), so only the rows looked up are read from disk.

A snapshot is written whole to a temporary file, fsync'd and renamed over the previous one, so a
SIGKILL leaves either the old snapshot or the new one, never half of one.
"""

from __future__ import annotations

import json
import os

import numpy as np

from elastic_step.ps.applied import AppliedGroups
from elastic_step.ps.ledger import _fsync_dir
from elastic_step.ps.routing import DEFAULT_VIRTUAL_SHARDS

MAGIC = b"ESS1\n"
MAX_NAMES_LINE = 1 << 20
TABLE_PARTS = ("ids", "rows", "updates", "index")


def save(path: str, tables: dict[str, dict[str, np.ndarray]], applied: dict[str, AppliedGroups]) -> None:
    arrays = {}
    for name, parts in tables.items():
        for key, array in parts.items():
            arrays[f"{name}.{key}"] = array
        for key, array in applied[name].to_arrays().items():
            arrays[f"{name}.applied_{key}"] = array
    partial = path + ".partial"
    with open(partial, "wb") as f:
        f.write(MAGIC + json.dumps(list(arrays)).encode() + b"\n")
        for array in arrays.values():
            np.lib.format.write_array(f, np.ascontiguousarray(array), allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
    _fsync_dir(path)


def _read(path: str, mapped: bool = False) -> dict[str, np.ndarray]:
    """Every array of the snapshot; `mapped`: each table's parts (TABLE_PARTS) as read-only
    memory maps of the file instead of arrays read into memory."""
    if not mapped:
        with open(path, "rb") as f:
            return {name: np.lib.format.read_array(f, allow_pickle=False) for name in _names(f, path)}
    arrays = {}
    with open(path, "rb") as f:
        for name, offset, shape, dtype in _located(f, path):
            if name.rsplit(".", 1)[-1] in TABLE_PARTS:
                arrays[name] = _map(path, offset, shape, dtype)
            else:  # the applied pushes: small, and kept by the shard
                f.seek(offset)
                arrays[name] = np.fromfile(f, dtype=dtype, count=int(np.prod(shape, dtype=np.int64))).reshape(shape)
    return arrays


def _names(f, path: str) -> list[str]:
    names_line = f.readline(MAX_NAMES_LINE) if f.readline(len(MAGIC)) == MAGIC else b""
    if not names_line.endswith(b"\n"):
        raise ValueError(f"{path} is not a shard snapshot")
    return json.loads(names_line)


def _located(f, path: str):
    """(name, offset, shape, dtype) of each array, from its .npy header alone (no object dtype,
    which would need pickle; ValueError for a file that is not a snapshot)."""
    located = []
    for name in _names(f, path):
        shape, fortran, dtype = _header(f)
        if dtype.hasobject or fortran:
            raise ValueError(f"{path}: array {name} is not a plain array")
        located.append((name, f.tell(), shape, dtype))
        f.seek(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, os.SEEK_CUR)
    return located


def load(path: str, table_names: list[str], virtual_shards: int = DEFAULT_VIRTUAL_SHARDS, mapped: bool = False
         ) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, AppliedGroups]]:
    """The snapshot's tables and applied batches; empty when there is no snapshot yet. `mapped`:
    the tables' arrays as memory maps, for a caller that copies them into arrays of its own (a
    shard's recovery: its reserved block, without the snapshot's rows held in memory beside it)."""
    tables, applied = {}, {}
    if not os.path.exists(path):
        return tables, applied
    data = _read(path, mapped)
    for name in table_names:
        if f"{name}.ids" not in data:
            continue
        tables[name] = {key: data[f"{name}.{key}"] for key in TABLE_PARTS}
        prefix = f"{name}.applied_"
        applied[name] = AppliedGroups.from_arrays(virtual_shards, {k[len(prefix):]: v for k, v in data.items() if k.startswith(prefix)})
    return tables, applied


def mapped(path: str, table_names: list[str]) -> dict[str, dict[str, np.ndarray]]:
    """The snapshot's tables (`ids`, `rows`, `index`) as read-only memory maps of the file, by
    name; a table it does not hold is left out. Only each array's .npy header is parsed (an
    object dtype, which would need pickle, is refused); ValueError for a file that is not a snapshot."""
    with open(path, "rb") as f:
        arrays = {name: (offset, shape, dtype) for name, offset, shape, dtype in _located(f, path)}
    tables = {}
    for table in table_names:
        if f"{table}.ids" in arrays:
            tables[table] = {key: _map(path, *arrays[f"{table}.{key}"]) for key in ("ids", "rows", "index")}
    return tables


def _header(f) -> tuple[tuple, bool, np.dtype]:
    version = np.lib.format.read_magic(f)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    return read(f)


def _map(path: str, offset: int, shape: tuple, dtype: np.dtype) -> np.ndarray:
    if int(np.prod(shape, dtype=np.int64)) == 0:  # mmap cannot map zero bytes
        return np.zeros(shape, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)
