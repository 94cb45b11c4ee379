"""A `--mode ps` job's shards where people look: the master's ShardMonitor asks each shard its
stats off the master's lock, keeps a shard's last numbers while it is down, and logs each one's
numbers to the run as ps.shardI.*, with its updates per second between two polls; /status carries
them (PsShardStatus); `get` and `top` show a row per shard, and an ended job's shards as ended. The end-to-end job in test_ps_mode.py checks
the same numbers against the shards' snapshots after a shard SIGKILL."""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest
from rich.console import Console

from elastic_step.master.ps_monitor import ShardMonitor
from elastic_step.protocol import JobStatus, PsShardState
from elastic_step.ps.api import TableSpec
from elastic_step.ps.ledger import LedgerRecord
from elastic_step.ps.routing import RoutingTable
from elastic_step.ps.shard import ShardServer
from elastic_step.ps.state import ShardState

pytestmark = pytest.mark.usefixtures("ledgers_closed")  # conftest.py: no ledger left open

TOKEN = "ps-status-token"
SPEC = TableSpec("emb", 4)


def serve(folder: str, port: int = 0) -> tuple[ShardState, ShardServer]:
    """A shard with its folder's tables, served in this process on `port` (0: any)."""
    state = ShardState(folder, [SPEC], 0, RoutingTable.initial(1, ["127.0.0.1:1"]))
    state.recover()
    server = ShardServer(("127.0.0.1", port), state, TOKEN)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return state, server


@pytest.fixture
def served(tmp_path):
    """One shard served in this process, and a supervisor's view of it (state, relaunches)."""
    state, server = serve(str(tmp_path))
    port = server.server_address[1]
    supervisor = types.SimpleNamespace(shards=types.SimpleNamespace(shards=[types.SimpleNamespace(host="127.0.0.1")]),
                                       ports=[port], states=[PsShardState.SERVING], relaunches=[0])
    yield state, server, supervisor
    server.shutdown()
    server.server_close()
    state.close()


def push(state: ShardState, task: int, ids: list[int]) -> None:
    state.push(LedgerRecord("emb", task, 0, 0, np.array(ids, np.int64), np.ones((len(ids), 4), np.float32)))


class Clock:
    """The monitor's clock, moved on by the test."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_monitor_shows_each_shards_numbers_logs_them_and_keeps_them_while_it_is_down(served):
    state, server, supervisor = served
    logged = []
    clock = Clock()
    monitor = ShardMonitor(supervisor, TOKEN, metric=lambda key, value, step, t: logged.append((key, value, step)), clock=clock)
    push(state, 1, [1, 2, 3])
    push(state, 2, [3, 4])
    push(state, 2, [3, 4])  # a re-sent push: applied once, counted once
    monitor.poll()
    address = f"127.0.0.1:{supervisor.ports[0]}"
    [row] = monitor.rows()
    assert row == {"shard": 0, "address": address, "state": PsShardState.SERVING, "rows": 4,
                   "bytes": state.tables["emb"].nbytes, "pushes": 2, "updates_per_s": None, "relaunches": 0}  # one poll: no rate yet
    assert row["bytes"] > 0
    assert sorted(logged) == [("ps.shard0.bytes", row["bytes"], 1), ("ps.shard0.pushes", 2, 1), ("ps.shard0.rows", 4, 1)]

    for task in range(3, 9):  # 6 more pushes in 4 s
        push(state, task, [5])
    clock.now += 4.0
    monitor.poll()
    [row] = monitor.rows()
    assert (row["pushes"], row["updates_per_s"]) == (8, 1.5)
    assert ("ps.shard0.updates_per_s", 1.5, 2) in logged and ("ps.shard0.pushes", 8, 2) in logged
    status = JobStatus.model_validate({"job": "j", "state": "running", "ps_shards": monitor.rows()})  # what /status answers
    assert (status.ps_shards[0].pushes, status.ps_shards[0].updates_per_s) == (8, 1.5)

    server.shutdown()  # the shard dies (its connections with it); the supervisor is relaunching it
    server.server_close()
    monitor.client.close()
    supervisor.states[0] = PsShardState.RELAUNCHING
    clock.now += 2.0
    monitor.poll()
    # its last numbers stand, but not a rate it is not applying now
    assert monitor.rows() == [{**row, "state": PsShardState.RELAUNCHING, "updates_per_s": None}]
    assert len(logged) == 7  # nothing logged for a shard that did not answer
    monitor.client.close()


def test_a_shard_whose_count_went_down_shows_no_rate_then_its_rate_from_there(served, tmp_path):
    """A shard relaunched without its rows (a pod's) or put back to a checkpoint's cut counts
    fewer pushes than at the last poll: no negative rate, and the next poll's rate counts from there."""
    state, server, supervisor = served
    clock = Clock()
    logged = []
    monitor = ShardMonitor(supervisor, TOKEN, metric=lambda key, value, step, t: logged.append((key, value)), clock=clock)
    for task in range(5):
        push(state, task, [task])
    monitor.poll()
    server.shutdown()  # the old shard dies, its connections with it (the fixture closes its state)
    server.server_close()
    monitor.client.close()
    (tmp_path / "relaunched").mkdir()
    fresh, relaunched = serve(str(tmp_path / "relaunched"), supervisor.ports[0])  # on its port, with nothing applied
    try:
        push(fresh, 1, [1])
        clock.now += 2.0
        monitor.poll()
        assert (monitor.rows()[0]["pushes"], monitor.rows()[0]["updates_per_s"]) == (1, None)
        assert not [value for key, value in logged if key.endswith("updates_per_s")]
        push(fresh, 2, [2])
        push(fresh, 3, [3])
        clock.now += 0.5
        monitor.poll()
        assert monitor.rows()[0]["updates_per_s"] == 4.0
        assert [value for key, value in logged if key.endswith("updates_per_s")] == [4.0]
    finally:
        monitor.client.close()
        relaunched.shutdown()
        relaunched.server_close()
        fresh.close()


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
           "updates_per_s": 38.4, "relaunches": 1},
          {"shard": 1, "address": "127.0.0.1:4101", "state": "down", "rows": 10, "bytes": 640, "pushes": 3, "updates_per_s": None,
           "relaunches": 3}]


@pytest.mark.parametrize("live, states", [(True, ["serving", "down"]), (False, ["ended", "down"])])
def test_get_and_top_show_a_row_per_shard(live, states):
    from elastic_step.cli.render import job_tables
    from elastic_step.operate.folder import view_of

    view = view_of(_job({"ps_shards": SHARDS}, live), "/jobs/j")
    assert [r["state"] for r in view["ps_shards"]] == states  # an ended job's shards stopped with it
    assert [r["pushes"] for r in view["ps_shards"]] == [77, 3]
    rate = "38.4" if live else "-"  # an ended job's shards update nothing more
    assert [r["updates_per_s"] for r in view["ps_shards"]] == ([38.4, None] if live else [None, None])  # get -o json
    console = Console(width=200, record=True)
    console.print(job_tables(view))
    lines = console.export_text().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("PS SHARD"))
    assert lines[header].split() == ["PS", "SHARD", "ADDRESS", "STATE", "ROWS", "MEMORY", "PUSHES", "UPDATES/S", "RELAUNCHES"]
    assert lines[header + 1].split() == ["0", "127.0.0.1:4100", states[0], "2500", "3.0", "MiB", "77", rate, "1"]
    assert lines[header + 2].split() == ["1", "127.0.0.1:4101", "down", "10", "640", "B", "3", "-", "3"]


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
