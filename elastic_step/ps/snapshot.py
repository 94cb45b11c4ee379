"""A shard's snapshot: every table's rows, counters and applied batches, in one .npz file.

Keys: `<table>.ids` (int64), `<table>.rows` (float32, weights and optimizer slots),
`<table>.updates` (uint32), `<table>.index` (int32: the id index, so that loading does not
rebuild it), and the pushes this shard has applied (applied.py):
`<table>.applied_below` (k x 2 int64: task, watermark) and `<table>.applied_above` (k x 2
int64: task, batch_seq). Loaded with allow_pickle=False: nothing in it is ever unpickled.

A snapshot is written whole to a temporary file, fsync'd and renamed over the previous one, so a
SIGKILL leaves either the old snapshot or the new one, never half of one.
"""

from __future__ import annotations

import os

import numpy as np

from elastic_step.ps.applied import AppliedKeys
from elastic_step.ps.ledger import _fsync_dir


def save(path: str, tables: dict[str, dict[str, np.ndarray]], applied: dict[str, AppliedKeys]) -> None:
    arrays = {}
    for name, parts in tables.items():
        for key, array in parts.items():
            arrays[f"{name}.{key}"] = array
        for key, array in applied[name].to_arrays().items():
            arrays[f"{name}.applied_{key}"] = array
    partial = path + ".partial"
    with open(partial, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
    _fsync_dir(path)


def load(path: str, table_names: list[str]) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, AppliedKeys]]:
    """The snapshot's tables and applied batches; empty when there is no snapshot yet."""
    tables, applied = {}, {}
    if not os.path.exists(path):
        return tables, applied
    with np.load(path, allow_pickle=False) as data:
        for name in table_names:
            if f"{name}.ids" not in data:
                continue
            tables[name] = {key: data[f"{name}.{key}"] for key in ("ids", "rows", "updates", "index")}
            applied[name] = AppliedKeys.from_arrays(data[f"{name}.applied_below"], data[f"{name}.applied_above"])
    return tables, applied
