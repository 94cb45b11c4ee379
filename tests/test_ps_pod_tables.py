"""The Kubernetes backend's trained tables at a --mode ps job's end (backends/kubernetes/ps_final.py),
with real shard processes standing in for the shard pods: the master reaches them only over the
shard protocol, as it reaches pods, never through their folders. Up to --ps-table-limit-mb it
holds the tables whole; past it the shards' snapshots come over the wire into
JOB_DIR/model/ps_shards, laid out as the local backend lays them out, and the master's models
look their rows up there. A snapshot crosses in parts, and one replaced mid-copy is refused."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from elastic_step.backends.kubernetes.ps_final import STAGING, freeze
from elastic_step.backends.kubernetes.ps_pod_shards import PodShard, PodShards
from elastic_step.backends.kubernetes.ps_pods import PsPods
from elastic_step.ps import embedding, local
from elastic_step.ps.api import PsError, TableSpec
from elastic_step.ps.client import PsClient
from elastic_step.ps.embedding import TableRows
from elastic_step.ps.local import LocalShards
from elastic_step.ps.shard_tables import MANIFEST_FILE, SHARDS_FOLDER, ShardTables
from lost_release import move_losing_a_release

pytestmark = pytest.mark.usefixtures("ledgers_closed")  # conftest.py: no ledger left open

TOKEN = "pod-tables-token"
SPECS = [TableSpec("pod_clicks", 4), TableSpec("pod_users", 3, lr=0.1)]


@pytest.fixture
def trained(tmp_path, monkeypatch):
    """Three shard processes (scaled from two) trained on ids 0..299 of both tables, none of whose
    pushes reached a snapshot yet (they are in the ledgers only); the master's client and the
    shards as the pod backend sees them. This process's table bindings are the test's own."""
    monkeypatch.setattr(embedding, "_FROZEN", {})
    monkeypatch.setattr(embedding, "_TABLE_SOURCES", {})
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    shards = LocalShards(str(tmp_path / "ps"), SPECS, 2, str(token_file), snapshot_every=100_000)
    shards.start()
    client = PsClient(TOKEN, shards.routes, timeout_s=30.0)
    try:
        shards.resize(3, client.call)
        rng = np.random.default_rng(7)
        for batch in range(6):
            for spec in SPECS:
                ids = rng.choice(300, size=50, replace=False).astype(np.int64)
                client.push(spec.name, 1, batch, 0, ids, rng.normal(size=(len(ids), spec.dim)).astype(np.float32))
        addresses = [s.endpoint.split(":") for s in shards.shards]
        pods = PodShards([PodShard(i, host, int(port)) for i, (host, port) in enumerate(addresses)], shards.routing)
        yield client, pods, tmp_path / "job"
    finally:
        client.close()
        shards.stop()


def looked_up(spec: TableSpec, ids: np.ndarray) -> np.ndarray:
    """The rows a model of this process gets for `ids` (its embeddings' source once frozen or bound)."""
    return TableRows(spec).distinct(ids, training=False)[2]


def test_past_the_limit_the_pods_snapshots_are_laid_out_as_the_local_backends_and_give_the_whole_tables_rows(trained):
    client, pods, job_dir = trained
    ids = np.arange(-3, 400, dtype=np.int64)  # never-trained ids among them
    # The pod backend's own call at the job's end (no Kubernetes API call is made in it).
    backend = SimpleNamespace(api=None, settings=SimpleNamespace(namespace="ml"), timeout_s=5.0, names=None,
                              spec=SimpleNamespace(job_dir=str(job_dir)))
    launcher = PsPods(backend)
    launcher.table_limit_mb = 0  # as start_shards sets it from --ps-table-limit-mb: any table is past 0 MB
    launcher._freeze(SPECS, pods, TOKEN)
    folder = job_dir / "model" / SHARDS_FOLDER
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    assert manifest["files"] == ["shard-0.bin", "shard-1.bin", "shard-2.bin"]
    assert manifest["owners"] == pods.routing.owners.tolist() and manifest["epoch"] == pods.routing.epoch
    assert not (job_dir / STAGING).exists()
    served = ShardTables.open(str(folder))
    sharded = {spec.name: looked_up(spec, ids) for spec in SPECS}
    for spec in SPECS:  # what the models were bound to is the folder's lookup
        np.testing.assert_array_equal(sharded[spec.name], served.rows(spec.name, ids))

    freeze(client, SPECS, pods, str(job_dir), limit_mb=1024)  # the same rows, held whole
    assert not folder.exists()  # the earlier attempt's folder would make the run log the pyfunc
    for spec in SPECS:
        whole = looked_up(spec, ids)
        assert embedding.frozen_table(spec.name) is not None
        # The ledgers' pushes are in the copied snapshots: the shards snapshot before giving them.
        np.testing.assert_array_equal(sharded[spec.name], whole)
        assert not whole[ids >= 300].any() and not whole[ids < 0].any()
        assert (np.abs(whole[(ids >= 0) & (ids < 300)]).sum(axis=1) > 0).mean() > 0.5


def test_a_backend_that_runs_the_shards_is_handed_the_jobs_table_limit(tmp_path, monkeypatch):
    """start_ps_shards gives the launcher (the pod backend's PsPods) train's --ps-table-limit-mb,
    which its freeze at the job's end decides by."""
    from contextlib import ExitStack

    from elastic_step.config import TrainConfig
    from elastic_step.master import ps_shards

    monkeypatch.setattr(ps_shards, "table_specs", lambda model_def: SPECS)  # the model definition's tables

    class Started(Exception):
        pass

    class Launcher:
        def start_shards(self, specs, count, token, resuming, running, **settings):
            raise Started(settings)

    (tmp_path / "token").write_text(TOKEN)
    config = TrainConfig(model_def="model.py", data=str(tmp_path), job_dir=str(tmp_path), mode="ps", ps_table_limit_mb=7.5)
    with ExitStack() as running, pytest.raises(Started) as started:
        ps_shards.start_ps_shards(config, str(tmp_path / "token"), running, launcher=Launcher())
    assert started.value.args[0]["table_limit_mb"] == 7.5


def test_a_snapshot_comes_from_a_pod_in_parts_whole_and_one_replaced_mid_copy_is_refused(tmp_path, monkeypatch):
    """fetch_snapshot against a shard served in this process, its frames cut to 64 bytes: the
    copy is the shard's snapshot byte for byte; one whose file a later snapshot replaces between
    two parts is refused (PsError), not pieced together from two snapshots."""
    import threading

    from elastic_step.backends.kubernetes.ps_pod_shards import fetch_snapshot
    from elastic_step.ps import cuts
    from elastic_step.ps.api import PsError
    from elastic_step.ps.ledger import LedgerRecord
    from elastic_step.ps.routing import RoutingTable
    from elastic_step.ps.shard import ShardServer
    from elastic_step.ps.state import SNAPSHOT_FILE, ShardState

    monkeypatch.setattr(cuts, "FILE_CHUNK", 64)
    (tmp_path / "shard").mkdir()
    state = ShardState(str(tmp_path / "shard"), SPECS, 0, RoutingTable.initial(1), snapshot_every=100_000, sync=False)
    state.recover()
    ids = np.arange(40, dtype=np.int64)
    state.push(LedgerRecord("pod_clicks", 1, 0, 0, ids, np.ones((40, 4), np.float32)))
    server = ShardServer(("127.0.0.1", 0), state, TOKEN)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    shard = PodShard(0, "127.0.0.1", server.server_address[1])
    client = PsClient(TOKEN, lambda: None, timeout_s=10.0)
    try:
        fetch_snapshot(client, shard, str(tmp_path / "copy.bin"))
        copied = (tmp_path / "copy.bin").read_bytes()
        assert len(copied) > 10 * 64 and copied == (tmp_path / "shard" / SNAPSHOT_FILE).read_bytes()

        asked = client.call

        def snapshot_again_after_a_part(endpoint, header, *arrays):
            answer = asked(endpoint, header, *arrays)
            if header["op"] == "snapshot_file" and header["offset"] == 64:
                state.snapshot()  # a new file in the snapshot's place
            return answer

        monkeypatch.setattr(client, "call", snapshot_again_after_a_part)
        with pytest.raises(PsError, match="changed or ended"):
            fetch_snapshot(client, shard, str(tmp_path / "mixed.bin"))
        assert not (tmp_path / "mixed.bin").exists()
    finally:
        client.close()
        server.shutdown()
        server.server_close()
        state.close()


@pytest.fixture
def two_shards(tmp_path, monkeypatch):
    """Two local shard processes of SPECS[0] (the pods' stand-ins: PodShards at their addresses)
    and a client; the embedding module's frozen tables start empty."""
    monkeypatch.setattr(embedding, "_FROZEN", {})
    monkeypatch.setattr(embedding, "_TABLE_SOURCES", {})
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    shards = LocalShards(str(tmp_path / "ps"), [SPECS[0]], 2, str(token_file), snapshot_every=100_000)
    shards.start()
    client = PsClient(TOKEN, shards.routes, timeout_s=30.0)
    try:
        yield shards, client
    finally:
        client.close()
        shards.stop()


@pytest.mark.parametrize("limit_mb", [1024, 0], ids=["whole", "snapshots"])
def test_a_scale_whose_release_failed_is_finished_before_the_tables_are_read(tmp_path, monkeypatch, limit_mb, two_shards):
    """2 -> 3 shards: the rows arrived and the shards train under the new routing, but one
    release was lost and the master gave up, its routing the old one: the old owners still hold
    stale copies of what they gave away. The job's end finishes the move first, so the model
    holds every row as trained last."""
    shards, client = two_shards
    spec, ids = SPECS[0], np.arange(300, dtype=np.int64)
    client.push(spec.name, 1, 0, 0, ids, np.ones((len(ids), spec.dim), np.float32))
    with monkeypatch.context() as patched:
        patched.setattr(local, "move", move_losing_a_release())
        with pytest.raises(PsError):
            shards.resize(3, client.call)
    client.push(spec.name, 1, 1, 0, ids, np.ones((len(ids), spec.dim), np.float32))  # under the new routing
    trained = client.pull(spec.name, ids).copy()
    addresses = [s.endpoint.split(":") for s in shards.shards]
    pods = PodShards([PodShard(i, host, int(port)) for i, (host, port) in enumerate(addresses)], shards.routing)
    assert pods.routing.epoch == 1 and len(pods.shards) == 3  # what the master knows after the failed move
    freeze(client, [spec], pods, str(tmp_path / "job"), limit_mb=limit_mb)
    assert pods.routing.epoch == 2
    np.testing.assert_array_equal(looked_up(spec, ids), trained)


def test_a_rollback_cut_short_in_its_routing_bump_is_not_taken_for_a_scale_at_the_jobs_end(tmp_path, monkeypatch, caplog,
                                                                                           two_shards):
    """A rollback (backends/kubernetes/ps_pod_watch.py, PodSupervisor.roll_back) gives every shard
    the routing's next epoch with the same owners (only the new pod's address changes). One that
    fails after some shards took it leaves them ahead of the master's routing, as a scale's move
    left mid-way would, but with no virtual shard changing owner: the job's end moves nothing,
    releases nothing, and does not say it finishes a move; the tables are read as they stand."""
    import logging

    from elastic_step.backends.kubernetes import ps_final
    from elastic_step.ps.routing import RoutingTable

    shards, client = two_shards
    spec, ids = SPECS[0], np.arange(300, dtype=np.int64)
    client.push(spec.name, 1, 0, 0, ids, np.random.default_rng(3).normal(size=(len(ids), spec.dim)).astype(np.float32))
    trained = client.pull(spec.name, ids).copy()
    addresses = [s.endpoint.split(":") for s in shards.shards]
    pods = PodShards([PodShard(i, host, int(port)) for i, (host, port) in enumerate(addresses)], shards.routing)
    bumped = RoutingTable(pods.routing.epoch + 1, pods.routing.owners, [s.endpoint for s in pods.shards])
    header, _ = client.call(pods.shards[0].endpoint, {"op": "routing", "routing": bumped.to_json()})  # shard 1 never got it
    assert header["epoch"] == bumped.epoch
    moved = []
    monkeypatch.setattr(ps_final, "move", lambda *args, **kwargs: moved.append("move"))
    monkeypatch.setattr(ps_final, "release", lambda *args, **kwargs: moved.append("release"))
    with caplog.at_level(logging.INFO, logger="elastic_step.backends.kubernetes"):
        freeze(client, [spec], pods, str(tmp_path / "job"), limit_mb=1024)
    assert moved == []
    assert "left mid-way" not in caplog.text and "did not finish" not in caplog.text
    assert f"routing epoch {bumped.epoch}" in caplog.text and "no virtual shard changes owner" in caplog.text
    np.testing.assert_array_equal(looked_up(spec, ids), trained)
