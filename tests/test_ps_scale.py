"""`scale --ps`: moving virtual shards between shards while pushes go on.

In-process shard states behind the shard's own request handling (no processes) for the rules:
only the virtual shards that change owner move, every row arrives whole (weights, slots,
counters), a push whose parts straddle the epoch change is applied once to every row, and a
virtual shard on its way is refused until it is installed, durably. Then real shard processes
resized 2 -> 3 -> 2 while a client pushes: every row updated exactly once per push."""

from __future__ import annotations

import threading
import time
from functools import partial

import numpy as np
import pytest

from elastic_step.ps import wire
from elastic_step.ps.api import OptimizerKind, Status, TableSpec
from elastic_step.ps.client import PsClient
from elastic_step.ps.ledger import LedgerRecord
from elastic_step.ps.local import LocalShards
from elastic_step.ps.moves import move, plan
from elastic_step.ps.routing import RoutingTable
from elastic_step.ps.shard import ShardServer
from elastic_step.ps.state import ShardState

pytestmark = pytest.mark.usefixtures("ledgers_closed")  # conftest.py: no ledger left open

SPEC = TableSpec("emb", 4)
TOKEN = "ps-scale-token"


def state(tmp_path, shard: int, routing: RoutingTable) -> ShardState:
    held = ShardState(str(tmp_path / f"shard-{shard}"), [SPEC], shard, routing, snapshot_every=10_000)
    (tmp_path / f"shard-{shard}").mkdir(parents=True, exist_ok=True)
    held.recover()
    return held


@pytest.fixture(name="state")
def closed_state(closing):
    """The tests' `state` (the helper above): each one it makes is closed at the test's end,
    whether the test passed or not (conftest.py's ledgers_closed)."""
    return lambda folder, shard, routing: closing(state(folder, shard, routing))


def caller(states: list[ShardState]):
    """call(shard, header, *arrays) answered by the shard's own request handling, in process."""

    def call(shard: int, header: dict, *arrays):
        server = ShardServer.__new__(ShardServer)  # its answer() without a socket
        server.state = states[shard]
        body = bytearray(b"".join(np.ascontiguousarray(a).view(np.uint8).reshape(-1).tobytes() for a in arrays))
        reply, out = server.answer(header, body)
        return reply, bytearray(b"".join(np.ascontiguousarray(a).view(np.uint8).reshape(-1).tobytes() for a in out))

    return call


def push(states: list[ShardState], routing: RoutingTable, key: tuple[int, int], ids: np.ndarray, only=None) -> None:
    """One push split over the owners as a client would (`only`: the shards whose part arrives)."""
    owner = routing.shard_of(ids)
    for shard in np.unique(owner):
        if only is None or shard in only:
            mine = ids[owner == shard]
            assert states[shard].check(routing.epoch, mine) is Status.OK
            states[shard].push(LedgerRecord(SPEC.name, *key, 0, mine, np.ones((len(mine), SPEC.dim), np.float32)))


def held(states: list[ShardState]) -> dict[int, tuple]:
    """id -> (row with its slots, updates) over all shards; each id held once."""
    rows = {}
    for s in states:
        table = s.tables[SPEC.name]
        for i in range(table.size):
            assert int(table.ids[i]) not in rows, f"id {table.ids[i]} held twice"
            rows[int(table.ids[i])] = (table.block[i].tobytes(), int(table.updates[i]))
    return rows


def test_only_the_virtual_shards_that_change_owner_move_and_every_row_arrives_whole(state, tmp_path):
    old = RoutingTable.initial(2)
    states = [state(tmp_path, i, old) for i in range(3)]  # the third starts empty, owning nothing
    ids = np.arange(20_000)
    for seq in range(5):
        push(states, old, (1, seq), ids[seq::3])
    before = held(states)
    new = old.resized(3)
    report = move(caller(states), old, new)
    assert report.moved == sum(len(v) for v in plan(old, new).values()) == int((old.owners != new.owners).sum())
    assert report.moved / 128 <= 1 / 3 + 0.05 and report.rows_moved / report.rows_total <= 1 / 3 + 0.05
    assert held(states) == before  # weights, Adagrad slots and counters, each id on one shard
    for s in states:
        table = s.tables[SPEC.name]
        assert (new.shard_of(table.ids[: table.size]) == s.shard).all() and table.size > 0
        assert s.routing.epoch == new.epoch and not s.pending


def test_tables_larger_than_a_message_move_and_export_a_messages_worth_at_a_time(state, tmp_path, monkeypatch):
    # A frame carries at most wire.MAX_BODY (1 GiB): a table of several GiB must cross in parts.
    # The same logic at a budget of 16 KiB against ~1 MiB of tables.
    from elastic_step.ps import moves

    monkeypatch.setattr(moves, "MESSAGE_BUDGET", 16 << 10)
    old = RoutingTable.initial(2)
    states = [state(tmp_path, i, old) for i in range(3)]
    ids = np.arange(20_000)
    push(states, old, (1, 0), ids)
    before = held(states)
    call, exports = caller(states), []

    def counting(shard, header, *arrays):
        reply, body = call(shard, header, *arrays)
        if header["op"] == "export":
            exports.append((len(header["vshards"]), len(body)))
        return reply, body

    new = old.resized(3)
    report = move(counting, old, new)
    assert held(states) == before and report.rows_moved > 0
    assert sum(n for n, _ in exports) == report.moved and max(n for n, _ in exports) < moves.CHUNK
    assert max(size for _, size in exports) <= 2 * moves.MESSAGE_BUDGET, exports  # hash spreads rows evenly

    # The end-of-job export of shard pods (ps_pods) asks the same way, and gets every row once.
    from elastic_step.backends.kubernetes.ps_pod_shards import exported

    class Asked:  # PsClient.call(endpoint, header, *arrays), answered in process by shard `endpoint`
        def call(self, endpoint, header, *arrays):
            return counting(endpoint, header, *arrays)

    exports.clear()
    shard = type("Shard", (), {"shard": 0, "endpoint": 0})()
    parts = list(exported(Asked(), shard, new.owned_by(0).tolist()))
    assert len(parts) == len(exports) > 1
    got = np.concatenate([p[f"{SPEC.name}.ids"] for p in parts])
    table = states[0].tables[SPEC.name]
    assert sorted(got.tolist()) == sorted(table.ids[: table.size].tolist())


def test_a_push_straddling_the_epoch_change_is_applied_once_to_every_row(state, tmp_path):
    old = RoutingTable.initial(2)
    states = [state(tmp_path, i, old) for i in range(3)]
    ids = np.arange(3000)
    push(states, old, (7, 0), ids)
    push(states, old, (7, 1), ids, only={1})  # shard 0's part is lost in the epoch change...
    new = old.resized(3)
    move(caller(states), old, new)
    moved = ids[(old.shard_of(ids) != new.shard_of(ids))]
    assert len(moved) and set(np.unique(old.shard_of(moved)).tolist()) == {0, 1}
    for _ in range(2):  # ...and re-sent whole under the new routing, twice
        push(states, new, (7, 1), ids)
    counts = {i: n for i, (_, n) in held(states).items()}
    assert counts == {int(i): 2 for i in ids}  # each row took each of the two keys once

    reference = [state(tmp_path / "ref", 0, RoutingTable.initial(1))]
    push(reference, reference[0].routing, (7, 0), ids)
    push(reference, reference[0].routing, (7, 1), ids)
    assert held(states) == held(reference)  # the same values as one shard applying each push once


def test_a_virtual_shard_on_its_way_is_refused_until_installed_and_that_survives_a_crash(state, tmp_path):
    old = RoutingTable.initial(2)
    states = [state(tmp_path, i, old) for i in range(3)]
    ids = np.arange(4000)
    push(states, old, (3, 0), ids)
    new = old.resized(3)
    coming = ids[new.shard_of(ids) == 2]
    states[2].adopt(new)
    assert states[2].check(new.epoch, coming) is Status.MOVING
    assert state(tmp_path, 2, old).check(new.epoch, coming) is Status.MOVING  # pending is durable
    call = caller(states)
    for source, vshards in ((s, v) for (s, t), v in plan(old, new).items() if t == 2):
        reply, body = call(source, {"op": "export", "vshards": vshards})
        arrays = wire.unpack(reply["arrays"], body)
        assert states[2].install(new, vshards, arrays) > 0
        assert states[2].install(new, vshards, arrays) == 0  # a re-sent import changes nothing
    assert states[2].check(new.epoch, coming) is Status.OK
    again = state(tmp_path, 2, old)  # a crash now: the snapshot has the rows, routing.json the epoch
    assert again.check(new.epoch, coming) is Status.OK and again.routing.epoch == new.epoch
    assert held([again]) == held([states[2]])
    again.push(LedgerRecord(SPEC.name, 3, 0, 0, coming, np.ones((len(coming), SPEC.dim), np.float32)))
    assert all(n == 1 for _, n in held([again]).values())  # the moved rows' keys came too


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN)
    return str(path)


def test_shard_processes_resized_while_a_client_pushes_apply_every_push_once(tmp_path, token_file):
    shards = LocalShards(str(tmp_path / "ps"), [SPEC], 2, token_file)
    shards.start()
    try:
        # The client only ever gets the first routing: it learns the next from the shards.
        first = shards.routes()
        client = PsClient(TOKEN, lambda: first, deadline_s=120)
        ids, resized, sent = np.arange(5000), threading.Event(), []

        def pushing():  # on through both resizes, and a few pushes after them
            after = 0
            while after < 5:
                seq = len(sent)
                part = ids[seq % 7 :: 7]
                client.push(SPEC.name, 1, seq, 0, part, np.ones((len(part), SPEC.dim), np.float32))
                sent.append(seq)
                after += resized.is_set()

        worker = threading.Thread(target=pushing)
        worker.start()
        admin = PsClient(TOKEN, lambda: None)
        while len(sent) < 10:  # the shards hold rows before the first move
            worker.join(timeout=0.05)
        grown = shards.resize(3, admin.call)
        shrunk = shards.resize(2, admin.call)
        resized.set()
        worker.join(timeout=300)
        assert not worker.is_alive()
        pushes = len(sent)
        assert grown.rows_moved / grown.rows_total <= 1 / 3 + 0.05 and grown.moved > 0 and shrunk.moved > 0
        assert client.routing.epoch == 3 and len(shards.shards) == 2
        counts = {}
        for shard in shards.shards:
            reply, body = admin.call(shard.endpoint, {"op": "counters", "table": SPEC.name})
            got = np.frombuffer(body, "<i8", count=reply["count"]), np.frombuffer(body, "<u4", offset=8 * reply["count"])
            counts.update(zip(got[0].tolist(), got[1].tolist()))
        expected = {int(i): sum(1 for seq in range(pushes) if i % 7 == seq % 7) for i in ids}
        assert counts == expected
        admin.close()
        client.close()
    finally:
        shards.stop()


def test_scale_ps_refusals_are_one_line_before_anything_moves(tmp_path, capsys):
    from elastic_step.cli import main as cli_main
    from elastic_step.master.ps_monitor import ShardMonitor
    from elastic_step.master.ps_supervisor import ShardSupervisor
    from elastic_step.protocol import PsShardState

    assert cli_main(["scale", str(tmp_path), "--ps", "0"]) == 2  # the CLI's code, in process: fast
    said = capsys.readouterr().err
    assert len(said.strip().splitlines()) == 1 and "--ps 0" in said, said
    with pytest.raises(SystemExit) as refused:
        cli_main(["scale", str(tmp_path), "--ps", "2", "--workers", "2"])
    assert refused.value.code == 2 and "not allowed with argument" in capsys.readouterr().err

    shards = LocalShards(str(tmp_path / "ps"), [SPEC], 2, str(tmp_path / "token"))  # never started: nothing may move
    supervisor = ShardSupervisor.__new__(ShardSupervisor)
    supervisor.shards, supervisor.stopping = shards, threading.Event()
    supervisor.states = [PsShardState.SERVING, PsShardState.RELAUNCHING]
    monitor = ShardMonitor.__new__(ShardMonitor)
    monitor.supervisor, monitor.stopping = supervisor, threading.Event()
    monitor.scaling, monitor.scale_asked = threading.Lock(), threading.Lock()
    monitor.fits, monitor.unfinished = None, None
    for count, words in [(2, "already runs 2"), (129, "between 1 and 128"), (3, "shard 1 is relaunching")]:
        with pytest.raises(ValueError, match=words):
            monitor.scale(count)
    monitor.unfinished = "the move to 3 shards did not finish (shard 2 did not answer)"  # as a failed scale leaves it
    with pytest.raises(ValueError, match=r"did not finish \(shard 2 did not answer\): stop the job and resume it"):
        monitor.scale(1)
    monitor.unfinished = None
    with monitor.scale_asked, pytest.raises(ValueError, match="another scale --ps of this job is under way"):
        monitor.scale(3)

    # A checkpoint's cut holding the shards is waited for, not refused (the operator cannot see
    # its timing): the scale goes on to its own checks once the cut lets go...
    monitor.scaling.acquire()
    cut = threading.Timer(0.5, monitor.scaling.release)
    started = time.monotonic()
    cut.start()
    with pytest.raises(ValueError, match="shard 1 is relaunching"):
        monitor.scale(3)
    assert time.monotonic() - started >= 0.45
    # ...and one that never lets go is named after a while.
    monitor.CUT_WAIT_S = 0.2
    with monitor.scaling, pytest.raises(ValueError, match="a checkpoint's cut or a rollback has held the shards"):
        monitor.scale(3)

    # Fewer shards hold more each: a declared table that fits two 1Gi shard pods does not fit one.
    from types import SimpleNamespace

    from elastic_step.master.ps_tables import check_table_sizes

    supervisor.states = [PsShardState.SERVING, PsShardState.SERVING]
    config = SimpleNamespace(ps_shards=2, backend="kubernetes", ps_memory="1Gi", worker_memory=None)
    declared = [TableSpec("big", 16, OptimizerKind.ADAGRAD, rows=8_000_000)]
    check_table_sizes(config, declared)  # as the job started: 0.8 GiB a shard
    monitor.fits = partial(check_table_sizes, config, declared)
    with pytest.raises(ValueError, match=r"need 1\.3 GiB on each of 1 shards, more than each shard pod's --ps-memory limit"):
        monitor.scale(1)
    # Local shards share this machine: after a scale its memory is divided among the new count.
    # Half of it in one declared table fits one shard, though not a quarter of the machine.
    from elastic_step.errors import ConfigError
    from elastic_step.ps.sizing import bytes_per_row, local_memory_bytes

    local = SimpleNamespace(ps_shards=4, backend="local", ps_memory=None, worker_memory=None)
    half = [TableSpec("half", 16, OptimizerKind.ADAGRAD, rows=int(local_memory_bytes() / 2 / 1.1 / bytes_per_row(spec)))
            for spec in declared]
    check_table_sizes(local, half, shards=1)
    with pytest.raises(ConfigError, match="on each of 1 shards, more than this machine's memory divided among them"):
        check_table_sizes(local, [TableSpec("most", 16, OptimizerKind.ADAGRAD, rows=half[0].rows * 2)], shards=1)


def test_applied_groups_answer_as_a_set_per_virtual_shard_would_through_moves_and_snapshots():
    from elastic_step.ps.applied import AppliedGroups, AppliedKeys

    rng, V = np.random.default_rng(9), 16
    groups, reference = AppliedGroups(V), {v: set() for v in range(V)}
    owned = np.zeros(V, bool)
    owned[: V // 2] = True
    for step in range(400):
        if step % 50 == 49:  # a move: some owned vshards leave, some arrive with keys of their own
            lost = owned & (rng.random(V) < 0.3)
            gained = ~owned & (rng.random(V) < 0.3)
            groups.split(lost)
            kept, owned = owned & ~lost, (owned & ~lost) | gained
            for _ in range(10):  # pushes go on before the rows arrive: what leaves stays as it was
                key = (int(rng.integers(0, 3)), int(rng.integers(0, 40)))
                groups.take(key, rng.choice(np.flatnonzero(kept), size=3), owned)
                for v in np.flatnonzero(kept):
                    reference[int(v)].add(key)
            probes = [(t, s) for t in range(3) for s in range(40)]
            for mask, keys in groups.export(np.flatnonzero(lost)):
                for v in np.flatnonzero(mask):
                    assert [p in keys for p in probes] == [p in reference[int(v)] for p in probes]
            arriving = []
            for v in np.flatnonzero(gained):
                keys = {(t, s) for t in range(3) for s in range(int(rng.integers(0, 30)))}
                reference[int(v)] = set(keys)
                held, mask = AppliedKeys(), np.zeros(V, bool)
                for key in keys:
                    held.add(key)
                mask[v] = True
                arriving.append((mask, held))
            groups.install(arriving)
            groups.forget(~owned)
            groups.compact(owned)
            groups = AppliedGroups.from_arrays(V, groups.to_arrays())  # through a snapshot
            continue
        key = (int(rng.integers(0, 3)), int(rng.integers(0, 40)))
        vshards = rng.choice(np.flatnonzero(owned), size=5)  # a part: ids in some owned vshards
        expected = np.array([key not in reference[int(v)] for v in vshards])
        assert groups.missing(key) or not expected.any()
        np.testing.assert_array_equal(groups.take(key, vshards, owned), expected)
        for v in np.flatnonzero(owned):
            reference[int(v)].add(key)


def test_a_growth_cut_short_keeps_its_added_shard_watched_relaunched_and_shown(tmp_path, token_file, monkeypatch):
    """A scale --ps that fails mid-move keeps the shards it added (a resume finishes the move
    with them): they must be watched like the others, or one that dies before the job's end is
    never relaunched, the move cannot be finished, and /status does not show it."""
    import signal

    from lost_release import move_losing_a_request

    from elastic_step.master.ps_monitor import ShardMonitor
    from elastic_step.master.ps_supervisor import ShardSupervisor
    from elastic_step.protocol import PsShardState
    from elastic_step.ps import local

    shards = LocalShards(str(tmp_path / "ps"), [SPEC], 1, token_file)
    shards.start()
    supervisor = ShardSupervisor(shards).start()
    monitor = ShardMonitor(supervisor, TOKEN)
    try:
        client = PsClient(TOKEN, shards.routes, deadline_s=60)
        ids = np.arange(200)
        client.push(SPEC.name, 1, 0, 0, ids, np.ones((len(ids), SPEC.dim), np.float32))  # rows to move
        client.close()
        monkeypatch.setattr(local, "move", move_losing_a_request("import", shard=1))  # shard 1 gains rows in 1 -> 2
        with pytest.raises(ValueError, match="the move to 2 shards did not finish"):
            monitor.scale(2)
        assert len(shards.shards) == 2 and len(supervisor.ports) == 2
        assert [row["shard"] for row in monitor.rows()] == [0, 1]  # /status shows the added shard
        assert monitor.rows()[1]["address"] == f"127.0.0.1:{supervisor.ports[1]}"
        shards.shards[1].kill(signal.SIGKILL)
        deadline = time.monotonic() + 60
        while supervisor.relaunches[1] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert supervisor.relaunches[1] == 1 and supervisor.states[1] is PsShardState.SERVING
        assert shards.shards[1].process.poll() is None
    finally:
        supervisor.stop()
        monitor.client.close()
        shards.stop()


def test_an_added_shard_that_cannot_start_fails_the_resize_and_leaves_no_process(tmp_path, token_file, monkeypatch):
    from elastic_step.master.ps_monitor import ShardMonitor
    from elastic_step.master.ps_supervisor import ShardSupervisor
    from elastic_step.ps import local

    shards = LocalShards(str(tmp_path / "ps"), [SPEC], 1, token_file)
    shards.start()
    started = []
    real_start = local.ShardProcess.start

    def never_ready(self, port: int = 0) -> None:
        real_start(self, port)
        started.append(self)
        if self.shard == 1:
            raise OSError("no room for the shard's folder")

    supervisor = ShardSupervisor(shards)
    monitor = ShardMonitor(supervisor, TOKEN)
    monkeypatch.setattr(local.ShardProcess, "start", never_ready)
    try:
        with pytest.raises(ValueError, match=r"^the move to 2 shards did not start \(an added shard did not start: no room "
                                             r"for the shard's folder\); nothing moved: the job goes on with 1 shard\(s\)$"):
            monitor.scale(2)
        assert len(shards.shards) == 1 and shards.routing.epoch == 1
        added = [s for s in started if s.shard == 1]
        assert added and added[0].process.poll() is not None  # ended, not left running unwatched
        assert monitor.unfinished is None  # nothing is mid-move: a later scale may try again
    finally:
        monitor.client.close()
        shards.stop()
