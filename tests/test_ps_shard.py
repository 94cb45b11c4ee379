"""A shard process's contract beyond exactly-once: requests under a stale routing epoch or for
ids it does not own are refused and the client re-routes and retries; the job token is checked;
a wildcard bind address or an empty token file is bad input; SIGTERM leaves a snapshot with
nothing to replay; a push queue delivers every push once, in order; a push is acknowledged only
after its ledger fsync, which runs while the push is applied, and a failed fsync stops the shard
before it acknowledges anything more."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from elastic_step.ps import wire
from elastic_step.ps.api import PsError, Status, TableSpec
from elastic_step.ps.client import PsClient, PushQueue
from elastic_step.ps.ledger import LedgerFailed, LedgerRecord
from elastic_step.ps.local import LocalShards, ShardProcess, write_config
from elastic_step.ps.routing import RoutingTable
from elastic_step.ps.shard import READY_FILE
from elastic_step.ps.state import LEDGER_FAILED_FILE, LEDGER_FILE, SNAPSHOT_FILE, ShardState
from elastic_step.ps.table import EmbeddingTable

pytestmark = pytest.mark.usefixtures("ledgers_closed")  # conftest.py: no ledger left open

TOKEN = "ps-shard-token"
SPEC = TableSpec("emb", 4)


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN)
    return str(path)


@pytest.fixture
def shards(tmp_path, token_file):
    started = LocalShards(str(tmp_path / "ps"), [SPEC], 2, token_file)
    started.start()
    yield started
    started.stop()


@pytest.fixture
def recovered(tmp_path, closing):
    """recovered(**settings): a shard state in tmp_path (ShardState's settings after its routing),
    recovered, and closed at the test's end whether the test passed or not (conftest.py's
    ledgers_closed). A test that patches os.fsync names this fixture before monkeypatch, so that
    the patch is undone before the close."""
    def make(**settings) -> ShardState:
        state = closing(ShardState(str(tmp_path), [SPEC], 0, RoutingTable.initial(1), **settings))
        state.recover()
        return state

    return make


def raw(endpoint: str, header: dict, *arrays) -> dict:
    host, port = endpoint.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        wire.send(sock, header, *arrays)
        return wire.receive(sock)[0]


def test_a_routing_epoch_bump_refuses_stale_requests_and_the_client_reroutes(shards):
    current = {"routing": shards.routes()}
    client = PsClient(TOKEN, lambda: current["routing"])
    ids = np.arange(500)
    before = client.pull(SPEC.name, ids)
    # Epoch 2 swaps the owners: every virtual shard moves (a row is created alike by its new owner).
    swapped = RoutingTable(2, 1 - shards.routing.owners, current["routing"].endpoints)
    for shard in shards.shards:
        assert client.call(shard.endpoint, {"op": "routing", "routing": swapped.to_json()})[0]["epoch"] == 2
    one_id = ids[:1]
    stale = raw(shards.shards[0].endpoint, {"op": "pull", "token": TOKEN, "epoch": 1, "table": SPEC.name, "count": 1}, one_id)
    assert stale["status"] == Status.STALE_EPOCH and stale["epoch"] == 2

    current["routing"] = swapped
    reply = client.push(SPEC.name, 1, 0, 0, ids, np.ones((500, SPEC.dim), np.float32))
    assert reply.retries == 2 and reply.applied == 2  # both refused under epoch 1, both applied under 2
    after = client.pull(SPEC.name, ids)
    assert not np.array_equal(after, before)  # the push landed on the new owners
    wrong = [s for s in range(2) if swapped.shard_of(one_id)[0] != s][0]
    refused = raw(shards.shards[wrong].endpoint, {"op": "pull", "token": TOKEN, "epoch": 2, "table": SPEC.name, "count": 1}, one_id)
    assert refused["status"] == Status.WRONG_SHARD

    shards.shards[0].kill(signal.SIGKILL)  # the epoch is durable: a relaunched shard keeps it
    shards.shards[0].start()
    assert shards.shards[0].wait_ready()["epoch"] == 2


def test_the_job_token_is_checked(shards):
    endpoint = shards.shards[0].endpoint
    header = {"op": "pull", "epoch": 1, "table": SPEC.name, "count": 1}
    assert raw(endpoint, {**header, "token": "wrong"}, np.arange(1))["status"] == Status.UNAUTHORIZED
    assert raw(endpoint, header, np.arange(1))["status"] == Status.UNAUTHORIZED
    with pytest.raises(PsError, match="unauthorized"):
        PsClient("wrong", shards.routes).pull(SPEC.name, np.arange(10))
    bad = raw(endpoint, {**header, "token": TOKEN, "table": "nope"}, np.arange(1))
    assert bad["status"] == Status.BAD_REQUEST
    nan = np.full((1, SPEC.dim), np.nan, np.float32)
    owned = np.arange(200)[shards.routing.shard_of(np.arange(200)) == 0][:1]
    push = {"op": "push", "token": TOKEN, "epoch": 1, "table": SPEC.name, "count": 1, "task": 0, "batch_seq": 0, "attempt": 0}
    assert raw(endpoint, push, owned, nan)["status"] == Status.BAD_REQUEST


def test_a_wildcard_bind_address_is_bad_input(tmp_path, token_file):
    directory = str(tmp_path / "shard")
    write_config(directory, [SPEC], RoutingTable.initial(1))
    command = [sys.executable, "-m", "elastic_step.ps.shard", "--dir", directory, "--shard", "0", "--host", "0.0.0.0", "--token-file", token_file]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "--host 0.0.0.0" in result.stderr
    assert not os.path.exists(os.path.join(directory, READY_FILE))


def test_an_empty_token_file_is_bad_input(tmp_path):
    """An empty token would let any request in (every header without one matches it)."""
    directory, empty = str(tmp_path / "shard"), tmp_path / "empty-token"
    empty.write_text("\n")
    write_config(directory, [SPEC], RoutingTable.initial(1))
    command = [sys.executable, "-m", "elastic_step.ps.shard", "--dir", directory, "--shard", "0", "--token-file", str(empty)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and f"the token file {empty} is empty" in result.stderr
    assert not os.path.exists(os.path.join(directory, READY_FILE))


def test_sigterm_leaves_a_snapshot_and_an_empty_ledger(shards):
    client = PsClient(TOKEN, shards.routes)
    for b in range(5):
        client.push(SPEC.name, 3, b, 0, np.arange(100) * (b + 1), np.ones((100, SPEC.dim), np.float32))
    shard = shards.shards[1]
    digest = client.call(shard.endpoint, {"op": "digest", "table": SPEC.name})[0]["digest"]
    assert shard.kill(signal.SIGTERM) == 0
    assert os.path.getsize(os.path.join(shard.directory, LEDGER_FILE)) == 0
    assert os.path.exists(os.path.join(shard.directory, SNAPSHOT_FILE))
    shard.start()
    assert shard.wait_ready()["replayed"] == 0
    assert client.call(shard.endpoint, {"op": "digest", "table": SPEC.name})[0]["digest"] == digest


def test_a_push_queue_delivers_every_push_once_in_order(shards):
    client = PsClient(TOKEN, shards.routes)
    pushes = PushQueue(PsClient(TOKEN, shards.routes))
    expected = EmbeddingTable(SPEC)
    for b in range(30):
        ids = (np.arange(50) * (b % 7 + 1)) % 200
        grads = np.full((50, SPEC.dim), 0.1 * (b + 1), np.float32)
        pushes.submit(SPEC.name, 5, b, 0, ids, grads)
        expected.push(ids, grads)
    pushes.wait()
    pushes.close()
    np.testing.assert_array_equal(client.pull(SPEC.name, np.arange(200)), expected.pull(np.arange(200)))
    broken = PushQueue(PsClient("wrong", shards.routes))
    broken.submit(SPEC.name, 6, 0, 0, np.arange(3), np.ones((3, SPEC.dim), np.float32))
    with pytest.raises(PsError, match="unauthorized"):
        broken.wait()
    broken.close()


def test_each_gradient_reaches_its_own_id_whatever_the_order_and_repeats_are_summed(shards):
    """A forward's distinct ids come in order of appearance, not sorted; several forwards may
    repeat an id. Against a reference table given the same pushes in one process."""
    client = PsClient(TOKEN, shards.routes)
    expected = EmbeddingTable(SPEC)
    rng = np.random.default_rng(4)
    distinct = rng.permutation(300)
    repeated = np.concatenate([distinct[:40], distinct[20:60]])
    for b, ids in enumerate((distinct, repeated)):
        grads = rng.normal(size=(len(ids), SPEC.dim)).astype(np.float32)
        client.push(SPEC.name, 9, b, 0, ids, grads)
        expected.push(ids, grads)
    np.testing.assert_allclose(client.pull(SPEC.name, np.arange(300)), expected.pull(np.arange(300)), rtol=1e-6, atol=1e-7)


def test_a_file_asked_for_from_a_negative_offset_is_a_bad_request_and_the_shard_serves_on(shards):
    endpoint = shards.shards[0].endpoint
    for header in ({"op": "snapshot_file", "offset": -1}, {"op": "cut_file", "step": 4, "part": "snapshot", "offset": -5}):
        reply = raw(endpoint, {**header, "token": TOKEN})
        assert reply["status"] == Status.BAD_REQUEST and "byte offset of 0 or more" in reply["detail"], reply
    assert raw(endpoint, {"op": "stats", "token": TOKEN})["status"] == Status.OK


def test_a_push_past_a_declared_tables_rows_is_a_bad_request_kept_out_of_the_ledger(tmp_path, token_file):
    """A declared table's shard refuses a push with an id outside [0, rows) before its ledger
    holds it (a replay of it would fail the shard's recovery), and serves on: a pull of such an
    id reads zeros, a push inside the range is applied, and a relaunch replays the ledger."""
    declared = TableSpec("declared", 2, rows=1000)
    started = LocalShards(str(tmp_path / "ps"), [declared], 1, token_file)
    started.start()
    try:
        endpoint = started.shards[0].endpoint
        push = {"op": "push", "token": TOKEN, "epoch": 1, "table": declared.name, "task": 0, "batch_seq": 0, "attempt": 0}
        reply = raw(endpoint, {**push, "count": 2}, np.array([5, 1000]), np.ones((2, 2), np.float32))
        assert reply["status"] == Status.BAD_REQUEST and "outside its declared rows" in reply["detail"], reply
        client = PsClient(TOKEN, started.routes)
        assert client.push(declared.name, 0, 0, 0, np.array([5]), np.ones((1, 2), np.float32)).applied == 1
        before = client.pull(declared.name, np.array([5, 1000, -3]))
        assert (before[1:] == 0).all() and (before[0] != 0).all()
        started.shards[0].kill(signal.SIGKILL)
        started.shards[0].start()
        started.shards[0].wait_ready()
        np.testing.assert_array_equal(client.pull(declared.name, np.array([5, 1000, -3])), before)
        client.close()
    finally:
        started.stop()


def _on_the_ledger(fd: int) -> bool:
    return os.readlink(f"/proc/self/fd/{fd}").endswith(LEDGER_FILE)


def _record(batch_seq: int, ids) -> LedgerRecord:
    ids = np.asarray(ids)
    return LedgerRecord(SPEC.name, 1, batch_seq, 0, ids, np.ones((len(ids), SPEC.dim), np.float32))


def test_a_push_is_acknowledged_after_its_fsync_which_runs_while_the_push_is_applied(recovered, tmp_path, monkeypatch):
    """The fsync is a wait on the disk: it starts once the record is written and the shard applies
    the push meanwhile (the step's time is the longer of the two, not their sum); the push is
    answered only when both are done."""
    state = recovered()
    fsync_began, disk_done, real_fsync = threading.Event(), threading.Event(), os.fsync

    def slow_fsync(fd):
        if _on_the_ledger(fd):
            fsync_began.set()
            disk_done.wait(10)
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    table, seen = state.tables[SPEC.name], {}
    apply = table.push

    def observed_apply(ids, grads):
        seen["fsync running during the apply"] = fsync_began.wait(3)
        return apply(ids, grads)

    table.push = observed_apply
    answered = threading.Event()
    pushing = threading.Thread(target=lambda: state.push(_record(0, range(10))) and answered.set())
    pushing.start()
    assert fsync_began.wait(10)
    assert not answered.wait(0.3)  # applied, written, not yet on disk: no answer
    disk_done.set()
    pushing.join(10)
    assert answered.is_set() and seen == {"fsync running during the apply": True}


def test_after_a_failed_ledger_fsync_the_shard_state_acknowledges_nothing_more(recovered, tmp_path, monkeypatch):
    """Linux reports a write-back error once and may drop the pages: a later fsync that succeeds
    says nothing of them, so neither a new push nor a re-sent one is acknowledged again."""
    state = recovered()
    assert state.push(_record(0, range(10)))
    real_fsync, failing = os.fsync, {"on": True}

    def fsync(fd):
        if failing["on"] and _on_the_ledger(fd):
            failing["on"] = False  # once: the next fsync would succeed
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(LedgerFailed, match="fsync failed .*Input/output error"):
        state.push(_record(1, range(10, 20)))
    for record in (_record(1, range(10, 20)), _record(2, range(20, 30))):  # the re-sent one, a new one
        with pytest.raises(LedgerFailed, match="records before it may not be on disk"):
            state.push(record)


def test_a_push_accepted_before_the_shard_closes_is_on_disk_before_it_is_answered(recovered, tmp_path, monkeypatch):
    """SIGTERM: the shard snapshots, then closes; a push accepted in between waits on a closed
    file's fsync and returns at once, so close() makes the ledger durable first."""
    from elastic_step.ps.ledger import Ledger

    monkeypatch.setattr(Ledger, "start_sync", lambda self, mark: None)  # no fsync but close()'s
    state = recovered()
    applied, mark = state.accept(_record(0, range(10)))
    assert applied and state.ledger.durable < mark
    state.close()
    assert state.ledger.durable >= mark
    state.ledger.sync_through(mark)  # what the push's thread then does: returns, as it is durable


def test_a_failed_fsync_starting_an_empty_ledger_after_a_snapshot_refuses_every_later_push_as_a_failed_ledger(recovered, tmp_path, monkeypatch):
    """The rotation closes the ledger before it makes the new one: if that fails, no file is
    open, and a push must stop the shard (LedgerFailed), not fail the job as a bad request."""
    state = recovered(snapshot_every=2)
    assert state.push(_record(0, range(10)))
    real_fsync = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(LEDGER_FILE + ".new"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(LedgerFailed, match="starting an empty ledger failed"):
        state.push(_record(1, range(10, 20)))  # the second push: a snapshot, then the rotation
    with pytest.raises(LedgerFailed, match="records before it may not be on disk"):
        state.push(_record(2, range(20, 30)))


FAILING_LEDGER_FSYNC = """
import errno, os, sys
real_fsync, flag = os.fsync, os.environ["FAIL_LEDGER_FSYNC"]
def fsync(fd):
    if os.path.exists(flag) and os.readlink(f"/proc/self/fd/{fd}").endswith("ledger.bin"):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    return real_fsync(fd)
os.fsync = fsync
from elastic_step.ps.shard import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_shard_whose_ledger_fsync_fails_stops_unanswered_and_its_relaunch_applies_each_push_once(tmp_path, token_file):
    """The shard process, its disk failing an fsync (EIO): the push gets no answer, the shard exits 1
    with one line a person can act on, and the relaunch from the same folder recovers what the
    disk holds; the client sends the push again and every row is updated exactly once."""
    directory, flag = str(tmp_path / "shard"), tmp_path / "fail-now"
    write_config(directory, [SPEC], RoutingTable.initial(1))
    shard = subprocess.Popen([sys.executable, "-c", FAILING_LEDGER_FSYNC, "--dir", directory, "--shard", "0",
                              "--token-file", token_file], env={**os.environ, "FAIL_LEDGER_FSYNC": str(flag)},
                             stderr=subprocess.PIPE, text=True)
    try:
        ready = os.path.join(directory, READY_FILE)
        deadline = time.monotonic() + 60
        while not os.path.exists(ready) and time.monotonic() < deadline and shard.poll() is None:
            time.sleep(0.02)
        with open(ready, encoding="utf-8") as f:
            info = json.load(f)
        endpoint = f"{info['host']}:{info['port']}"
        push = {"op": "push", "token": TOKEN, "epoch": 1, "table": SPEC.name, "task": 1, "attempt": 0, "count": 10}
        ones = np.ones((10, SPEC.dim), np.float32)
        assert raw(endpoint, {**push, "batch_seq": 0}, np.arange(10), ones) == {"status": Status.OK, "applied": True}
        flag.touch()
        with pytest.raises((ConnectionError, wire.FrameError, OSError)):
            raw(endpoint, {**push, "batch_seq": 1}, np.arange(10, 20), ones)
        assert shard.wait(timeout=30) == 1
        stderr = shard.stderr.read()
        said = [line for line in stderr.splitlines() if "fsync failed ([Errno 5] Input/output error)" in line]
        assert len(said) == 1 and "relaunched shard recovers" in said[0] and "Traceback" not in stderr, stderr
        assert os.path.exists(os.path.join(directory, LEDGER_FAILED_FILE))  # for the relaunch
    finally:
        if shard.poll() is None:
            shard.kill()
        shard.wait()
    relaunched = ShardProcess(directory, 0, token_file)
    relaunched.start()
    try:
        relaunched.wait_ready()
        # What it replayed may have come from the kernel's cache, not the disk: it wrote a snapshot.
        assert not os.path.exists(os.path.join(directory, LEDGER_FAILED_FILE))
        assert os.path.exists(os.path.join(directory, SNAPSHOT_FILE))
        assert os.path.getsize(os.path.join(directory, LEDGER_FILE)) == 0
        endpoint = relaunched.endpoint
        assert raw(endpoint, {**push, "batch_seq": 1}, np.arange(10, 20), ones)["status"] == Status.OK
        client = PsClient(TOKEN, lambda: RoutingTable.initial(1))
        header, body = client.call(endpoint, {"op": "counters", "table": SPEC.name})
        client.close()
        ids, updates = np.frombuffer(body, "<i8", header["count"]), np.frombuffer(body, "<u4", offset=8 * header["count"])
        assert sorted(ids.tolist()) == list(range(20)) and (updates == 1).all(), (ids, updates)
    finally:
        relaunched.kill(signal.SIGKILL)


def test_the_note_for_the_relaunch_is_left_when_the_disk_refuses_every_fsync(recovered, tmp_path, monkeypatch):
    """The relaunch this note is for runs on the same node, and sees the file in the kernel's
    cache whether or not it reached the disk: a failing fsync must not take the note away."""
    state = recovered()

    def failing(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", failing)
    state.note_failed_ledger()
    assert os.path.exists(tmp_path / LEDGER_FAILED_FILE)


@pytest.mark.parametrize("error, code, says", [
    (OSError(errno.EIO, os.strerror(errno.EIO)), 1, "the volume of {dir} failed: [Errno 5] Input/output error; "
                                                    "check it (`dmesg` shows its I/O errors, `df` a full disk)"),
    (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/data/shard/snapshot.bin"), 1,
     "the volume of /data/shard/snapshot.bin failed: [Errno 28] No space left on device: '/data/shard/snapshot.bin'; check it"),
    (FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), "config.json"), 2, "check --dir, --host and --token-file"),
])
def test_a_shard_that_cannot_start_says_whether_its_volume_failed_or_its_flags_are_wrong(tmp_path, token_file, monkeypatch,
                                                                                        capsys, error, code, says):
    # A failing volume (an EIO loading the snapshot, a full disk) is worth a relaunch (exit 1); a
    # wrong flag fails the same way every time (exit 2).
    from elastic_step.ps import shard as shard_module

    def failing(args):
        raise error

    monkeypatch.setattr(shard_module, "serve", failing)
    directory = str(tmp_path / "shard")
    assert shard_module.main(["--dir", directory, "--shard", "0", "--token-file", token_file]) == code
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("elastic_step.ps.shard: ") and says.format(dir=directory) in line, line
