"""A `--mode ps` model's tables served from the shards' final snapshots, for a model whose tables
are too big for one process to hold whole (`train --ps-table-limit-mb`).

The folder (a run's `elastic_step_model/ps_shards/`): each shard's last snapshot as it was on
disk (`shard-I.bin`, snapshot.py's format: no pickle) and `manifest.json`: the tables' specs and
the routing (which shard owns each virtual shard). The snapshots are memory-mapped, each shard's
rows kept apart, so a lookup reads only the rows it asks for: it routes the ids as a client
would (RoutingTable.shard_of), then finds each shard's part in that shard's own id index, saved
in its snapshot (a table indexed directly, whose index no snapshot keeps: one index of the whole
table, built from the shards' ids when the folder is opened); an id no shard holds (never trained on) gets a zero row, as a model given the
whole table does (embedding.TableRows.frozen_rows).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

from elastic_step.ps import snapshot
from elastic_step.ps.api import TableSpec
from elastic_step.ps.embedding import RowSource
from elastic_step.ps.index import DirectIndex, IdIndex, uses_direct_index
from elastic_step.ps.routing import RoutingTable

SHARDS_FOLDER = "ps_shards"  # beside the final model's weights file
MANIFEST_FILE = "manifest.json"
FORMAT = 1


def table_bytes(spec: TableSpec, rows: int) -> int:
    """What `rows` rows of a table take held whole: their ids and weights, optimizer slots left out."""
    return rows * (8 + 4 * spec.dim)


def weight_bytes(snapshots: list[str], specs: list[TableSpec]) -> int:
    """What the tables' ids and weights (optimizer slots left out) take held whole in one process;
    read from the snapshots' array headers, not their rows."""
    total = 0
    for path in snapshots:
        if not os.path.exists(path):
            continue
        tables = snapshot.mapped(path, [spec.name for spec in specs])
        total += sum(table_bytes(s, len(tables[s.name]["ids"])) for s in specs if s.name in tables)
    return total


def write_folder(folder: str, specs: list[TableSpec], routing: RoutingTable, snapshots: list[str]) -> None:
    """The shards' snapshots (shard I's is snapshots[I]; a shard that never took one holds
    nothing) and the manifest, under `folder`. A snapshot is linked where the file system allows:
    it is not written again, and the shard that wrote it has stopped."""
    os.makedirs(folder, exist_ok=True)
    files = []
    for shard, path in enumerate(snapshots):
        if not os.path.exists(path):
            files.append(None)
            continue
        files.append(f"shard-{shard}.bin")
        target = os.path.join(folder, files[-1])
        if os.path.exists(target):
            os.remove(target)
        try:
            os.link(path, target)
        except OSError:
            shutil.copyfile(path, target)
    manifest = {"format": FORMAT, "tables": [spec.to_json() for spec in specs], "owners": routing.owners.tolist(),
                "epoch": routing.epoch, "files": files}
    with open(os.path.join(folder, MANIFEST_FILE), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)


class ShardTables:
    """The tables of a shards' folder (write_folder), looked up shard by shard."""

    def __init__(self, specs: list[TableSpec], routing: RoutingTable, shards: list[dict]):
        self.specs = {spec.name: spec for spec in specs}
        self.routing = routing
        direct = {name: DirectIndex(spec.rows) for name, spec in self.specs.items() if uses_direct_index(spec.rows)}
        # per shard, per table: (its ids, its rows with the optimizer slots, its id index)
        self.shards = [{name: (t["ids"], t["rows"], self._index(shard, t, direct.get(name)))
                        for name, t in tables.items()} for shard, tables in enumerate(shards)]

    def _index(self, shard: int, table: dict, direct: DirectIndex | None) -> IdIndex | DirectIndex:
        """A shard's saved hash index, memory-mapped; or, for a table indexed directly (whose index
        no snapshot keeps), one index of the whole table shared by its shards, filled with each
        shard's slots of the ids the routing gives it (4 bytes per declared id in all)."""
        ids = table["ids"]
        if direct is None:
            return IdIndex.from_slots(np.asarray(table["index"]), len(ids))
        owned = np.flatnonzero(self.routing.shard_of(np.asarray(ids)) == shard)
        direct.insert(np.asarray(ids[owned]), owned, ids)
        return direct

    @classmethod
    def open(cls, folder: str) -> ShardTables:
        """ValueError (one line) for a folder write_folder did not write."""
        try:
            with open(os.path.join(folder, MANIFEST_FILE), encoding="utf-8") as f:
                manifest = json.load(f)
            specs = [TableSpec.from_json(table) for table in manifest["tables"]]
            routing = RoutingTable(int(manifest["epoch"]), np.asarray(manifest["owners"], dtype=np.int64))
            files = manifest["files"]
            if manifest.get("format") != FORMAT or len(files) != routing.shards:
                raise ValueError(f"format {manifest.get('format')}, {len(files)} files for {routing.shards} shards")
            names = [spec.name for spec in specs]
            shards = [snapshot.mapped(os.path.join(folder, os.path.basename(name)), names) if name else {} for name in files]
            return cls(specs, routing, shards)
        except (OSError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{folder} is not a folder of parameter-server shard snapshots written by elastic-step: "
                             f"{type(exc).__name__}: {str(exc)[:200]}") from None

    def rows(self, table: str, ids: np.ndarray) -> np.ndarray:
        """The rows of `ids` (any shape) of `table`: len(ids) x dim float32, zeros where no shard holds one."""
        spec = self.specs[table]
        flat = np.asarray(ids).reshape(-1).astype(np.int64, copy=False)
        out = np.zeros((len(flat), spec.dim), np.float32)
        owners = self.routing.shard_of(flat)
        for shard, tables in enumerate(self.shards):
            if table not in tables:
                continue
            at = np.flatnonzero(owners == shard)
            held_ids, held_rows, index = tables[table]
            slots = index.find(flat[at], held_ids) if len(held_ids) else np.full(len(at), -1)
            found = slots >= 0
            out[at[found]] = held_rows[slots[found], : spec.dim]
        return out.reshape(*np.shape(ids), spec.dim)

    def sources(self) -> dict[str, RowSource]:
        """Each table's lookup, as a model's embeddings take their rows (TableRows.source, bind_tables)."""
        return {name: (lambda ids, name=name: self.rows(name, ids)) for name in self.specs}
