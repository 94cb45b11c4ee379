"""A --mode ps model's tables served from the shards' snapshots (ps/shard_tables.py): the rows a
lookup gives are those the whole table frozen into the master gives, over real snapshot files
written by ShardState."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from elastic_step.master.ps_rows import snapshot_table
from elastic_step.ps.api import TableSpec
from elastic_step.ps.embedding import TableRows
from elastic_step.ps.ledger import LedgerRecord
from elastic_step.ps.routing import RoutingTable
from elastic_step.ps.shard_tables import MANIFEST_FILE, ShardTables, weight_bytes, write_folder
from elastic_step.ps.state import SNAPSHOT_FILE, ShardState

pytestmark = pytest.mark.usefixtures("ledgers_closed")  # conftest.py: no ledger left open

SPECS = [TableSpec("clicks", 4), TableSpec("users", 3, lr=0.1, rows=350)]  # users: declared, indexed directly
SHARDS = 3


@pytest.fixture
def snapshots(tmp_path) -> tuple[RoutingTable, list[str]]:
    """Three shards trained on ids 0..299 of both tables (each push split over the owners as a
    client splits it), after a scale from 2 shards, each stopped with its last snapshot."""
    routing = RoutingTable.initial(2).resized(SHARDS)
    rng = np.random.default_rng(4)
    states = []
    for shard in range(SHARDS):
        folder = tmp_path / f"shard-{shard}"
        folder.mkdir()
        states.append(ShardState(str(folder), SPECS, shard, routing, snapshot_every=10_000, sync=False))
        states[-1].recover()
    for batch in range(5):
        for spec in SPECS:
            ids = rng.choice(300, size=40, replace=False).astype(np.int64)
            owner = routing.shard_of(ids)
            for shard in np.unique(owner):
                mine = ids[owner == shard]
                grads = rng.normal(size=(len(mine), spec.dim)).astype(np.float32)
                states[shard].push(LedgerRecord(spec.name, 1, batch, 0, mine, grads))
    for state in states:
        state.snapshot()
        state.close()
    return routing, [str(tmp_path / f"shard-{shard}" / SNAPSHOT_FILE) for shard in range(SHARDS)]


def whole_table_rows(spec: TableSpec, snapshots: list[str], ids: np.ndarray) -> np.ndarray:
    """What a model holding the whole table (the master's freeze) looks these ids up as."""
    rows = TableRows(spec)
    rows.hold(*snapshot_table(spec, [os.path.dirname(p) for p in snapshots]))
    return rows.frozen_rows(ids)


def test_a_lookup_shard_by_shard_gives_the_whole_tables_rows_and_zeros_for_ids_never_trained(snapshots, tmp_path):
    routing, files = snapshots
    folder = tmp_path / "served"
    write_folder(str(folder), SPECS, routing, files)
    tables = ShardTables.open(str(folder))
    ids = np.arange(-5, 400, dtype=np.int64).reshape(-1, 5)  # negative and never-trained ids among them
    for spec in SPECS:
        got = tables.rows(spec.name, ids)
        assert got.shape == (*ids.shape, spec.dim) and got.dtype == np.float32
        np.testing.assert_array_equal(got, whole_table_rows(spec, files, ids))
        assert np.abs(got).sum(axis=-1)[ids >= 300].max() == 0  # never trained: zeros
        assert (np.abs(got).sum(axis=-1)[(ids >= 0) & (ids < 300)] > 0).mean() > 0.4  # trained rows are there
    assert tables.sources()["users"](np.array([7, 8])).shape == (2, 3)


def test_the_weight_bytes_count_ids_and_weights_not_optimizer_slots(snapshots):
    _, files = snapshots
    held = {spec.name: len(snapshot_table(spec, [os.path.dirname(p) for p in files])[0]) for spec in SPECS}
    assert weight_bytes(files, SPECS) == held["clicks"] * (8 + 16) + held["users"] * (8 + 12)


def test_a_shard_without_a_snapshot_holds_nothing_and_a_broken_folder_is_one_line(snapshots, tmp_path):
    routing, files = snapshots
    folder = tmp_path / "served"
    write_folder(str(folder), SPECS, routing, [files[0], str(tmp_path / "none" / SNAPSHOT_FILE), files[2]])
    tables = ShardTables.open(str(folder))
    ids = np.arange(300, dtype=np.int64)
    on_shard_1 = routing.shard_of(ids) == 1
    got = tables.rows("clicks", ids)
    assert not got[on_shard_1].any() and got[~on_shard_1].any()

    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    (folder / MANIFEST_FILE).write_text(json.dumps({**manifest, "files": manifest["files"][:2]}))
    with pytest.raises(ValueError) as refused:
        ShardTables.open(str(folder))
    assert "not a folder of parameter-server shard snapshots" in str(refused.value) and "\n" not in str(refused.value)
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest))
    (folder / "shard-2.bin").write_bytes(b"ESS1\nnot json")
    with pytest.raises(ValueError, match="not a folder of parameter-server shard snapshots"):
        ShardTables.open(str(folder))
