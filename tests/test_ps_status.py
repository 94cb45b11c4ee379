"""A `--mode ps` job's shards where people look: the master's ShardMonitor asks each shard its
stats off the master's lock, keeps a shard's last numbers while it is down, and logs each one's
numbers to the run as ps.shardI.*; /status carries them (PsShardStatus); `get` and `top` show a
row per shard, and an ended job's shards as ended. The end-to-end job in test_ps_mode.py checks
the same numbers against the shards' snapshots after a shard SIGKILL."""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest
from rich.console import Console

from elastic_step.master.ps_shards import ShardMonitor
from elastic_step.protocol import JobStatus, PsShardState
from elastic_step.ps.api import TableSpec
from elastic_step.ps.ledger import LedgerRecord
from elastic_step.ps.routing import RoutingTable
from elastic_step.ps.shard import ShardServer
from elastic_step.ps.state import ShardState

TOKEN = "ps-status-token"
SPEC = TableSpec("emb", 4)


@pytest.fixture
def served(tmp_path):
    """One shard served in this process, and a supervisor's view of it (state, relaunches)."""
    state = ShardState(str(tmp_path), [SPEC], 0, RoutingTable.initial(1, ["127.0.0.1:1"]))
    state.recover()
    server = ShardServer(("127.0.0.1", 0), state, TOKEN)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    port = server.server_address[1]
    supervisor = types.SimpleNamespace(shards=types.SimpleNamespace(shards=[types.SimpleNamespace(host="127.0.0.1")]),
                                       ports=[port], states=[PsShardState.SERVING], relaunches=[0])
    yield state, server, supervisor
    server.shutdown()
    server.server_close()
    state.close()


def push(state: ShardState, task: int, ids: list[int]) -> None:
    state.push(LedgerRecord("emb", task, 0, 0, np.array(ids, np.int64), np.ones((len(ids), 4), np.float32)))


def test_the_monitor_shows_each_shards_numbers_logs_them_and_keeps_them_while_it_is_down(served):
    state, server, supervisor = served
    logged = []
    monitor = ShardMonitor(supervisor, TOKEN, metric=lambda key, value, step, t: logged.append((key, value, step)))
    push(state, 1, [1, 2, 3])
    push(state, 2, [3, 4])
    push(state, 2, [3, 4])  # a re-sent push: applied once, counted once
    monitor.poll()
    address = f"127.0.0.1:{supervisor.ports[0]}"
    [row] = monitor.rows()
    assert row == {"shard": 0, "address": address, "state": PsShardState.SERVING, "rows": 4,
                   "bytes": state.tables["emb"].nbytes, "pushes": 2, "relaunches": 0}
    assert row["bytes"] > 0
    assert sorted(logged) == [("ps.shard0.bytes", row["bytes"], 1), ("ps.shard0.pushes", 2, 1), ("ps.shard0.rows", 4, 1)]
    status = JobStatus.model_validate({"job": "j", "state": "running", "ps_shards": monitor.rows()})  # what /status answers
    assert status.ps_shards[0].pushes == 2

    server.shutdown()  # the shard dies (its connections with it); the supervisor is relaunching it
    server.server_close()
    monitor.client.close()
    supervisor.states[0] = PsShardState.RELAUNCHING
    monitor.poll()
    assert monitor.rows() == [{**row, "state": PsShardState.RELAUNCHING}]  # its last numbers stand
    assert len(logged) == 3  # nothing logged for a shard that did not answer
    monitor.client.close()


def test_a_monitor_with_the_wrong_token_keeps_zeros_rather_than_failing(served):
    state, _, supervisor = served
    push(state, 1, [1])
    monitor = ShardMonitor(supervisor, "not-the-token")
    monitor.poll()
    assert [(r["rows"], r["pushes"]) for r in monitor.rows()] == [(0, 0)]
    monitor.client.close()


def _job(status: dict, live: bool) -> dict:
    return {"status": {"job": "j", "state": "running", "started_at": 1.0, **status}, "info": {}, "result": None,
            "events": [], "live": live}


SHARDS = [{"shard": 0, "address": "127.0.0.1:4100", "state": "serving", "rows": 2500, "bytes": 3 << 20, "pushes": 77,
           "relaunches": 1},
          {"shard": 1, "address": "127.0.0.1:4101", "state": "down", "rows": 10, "bytes": 640, "pushes": 3, "relaunches": 3}]


@pytest.mark.parametrize("live, states", [(True, ["serving", "down"]), (False, ["ended", "down"])])
def test_get_and_top_show_a_row_per_shard(live, states):
    from elastic_step.cli.render import job_tables
    from elastic_step.operate.folder import view_of

    view = view_of(_job({"ps_shards": SHARDS}, live), "/jobs/j")
    assert [r["state"] for r in view["ps_shards"]] == states  # an ended job's shards stopped with it
    assert [r["pushes"] for r in view["ps_shards"]] == [77, 3]
    console = Console(width=200, record=True)
    console.print(job_tables(view))
    lines = console.export_text().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("PS SHARD"))
    assert lines[header].split() == ["PS", "SHARD", "ADDRESS", "STATE", "ROWS", "MEMORY", "PUSHES", "RELAUNCHES"]
    assert lines[header + 1].split() == ["0", "127.0.0.1:4100", states[0], "2500", "3.0", "MiB", "77", "1"]
    assert lines[header + 2].split() == ["1", "127.0.0.1:4101", "down", "10", "640", "B", "3", "3"]


def test_a_dense_job_shows_no_shard_table():
    from elastic_step.cli.render import job_tables
    from elastic_step.operate.folder import view_of

    view = view_of(_job({}, True), "/jobs/j")
    assert "ps_shards" not in view
    console = Console(width=200, record=True)
    console.print(job_tables(view))
    assert "PS SHARD" not in console.export_text()


def test_the_first_poll_after_a_relaunch_shows_the_relaunched_shards_numbers(served):
    """A relaunched shard closed the connection the monitor kept to it: the next poll (the last
    one, when the job ends right after) asks again on a new connection instead of keeping the
    numbers the shard had before it died."""
    state, server, supervisor = served
    monitor = ShardMonitor(supervisor, TOKEN)
    push(state, 1, [1, 2, 3])
    monitor.poll()
    assert monitor.rows()[0]["rows"] == 3
    kept = monitor.client._connections[f"127.0.0.1:{supervisor.ports[0]}"]
    kept.shutdown(__import__("socket").SHUT_RDWR)  # what the old process's death does to it
    push(state, 2, [4, 5])
    monitor.poll()
    assert monitor.rows()[0]["rows"] == 5
    monitor.client.close()
