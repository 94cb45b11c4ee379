"""A shard's rollback to a checkpoint's cut behind a fence of rounds (ps/state.py), the half of a
mode ps job's in-process return to its newest checkpoint that the shards do (master/ps_rollback.py):
the shard holds exactly its cut of the step again and then re-applies what is trained after it,
refuses every push of a round up to the fence, across a restart too, as a RoundFenced the worker
takes as the end of its round (not a PsError, which fails the job), cuts no later step from the
tables it went back to, and refuses a cut that is not the recorded one without changing anything."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from elastic_step.ps import cuts
from elastic_step.ps.api import PsError, RoundFenced, Status
from elastic_step.ps.client import PsClient
from elastic_step.ps.ledger import LedgerRecord
from elastic_step.ps.routing import RoutingTable
from elastic_step.ps.shard import ShardServer
from elastic_step.ps.state import Refused
from test_ps_cuts import IDS, SPEC, failing_after_the_first_copy, shard

pytestmark = pytest.mark.usefixtures("ledgers_closed")  # conftest.py: no ledger left open

TOKEN = "rollback-token"


@pytest.fixture(name="shard")
def closed_shard(closing):
    """The tests' `shard` (test_ps_cuts' helper): each state it makes is closed at the test's end,
    whether the test passed or not (conftest.py's ledgers_closed)."""
    return lambda directory, every=2: closing(shard(directory, every))


def push(held, step: int, round_id: int) -> bool:
    """Step `step`'s minibatch (the same key whichever round trains it), pushed in round `round_id`."""
    grads = np.full((3, 2), 0.1 * step, np.float32)
    return held.push(LedgerRecord(SPEC.name, 1, step, round_id, IDS, grads), step=step)


def test_a_rollback_holds_the_cut_again_and_fences_the_rounds_before_it(shard, tmp_path):
    held = shard(tmp_path / "s")
    push(held, 1, round_id=1), push(held, 2, round_id=1)
    at_checkpoint = held.tables[SPEC.name].digest()
    push(held, 3, round_id=1), push(held, 4, round_id=2), push(held, 5, round_id=2)  # cuts of 2 and 4 on the way
    ahead = held.tables[SPEC.name].digest()
    cut = held.cut(2)
    assert cuts.steps(str(tmp_path / "s")) == [2, 4]
    with pytest.raises(cuts.CutMissing, match="SHA-256"):  # not the recorded cut: nothing changes
        held.rollback(2, "0" * 64, fence=2)
    assert held.tables[SPEC.name].digest() == ahead and held.fence == 0

    held.rollback(2, cut["digest"], fence=2)
    assert held.tables[SPEC.name].digest() == at_checkpoint
    assert cuts.steps(str(tmp_path / "s")) == [2]  # the cut of step 4 went with what it held
    with pytest.raises(cuts.CutMissing):  # its tables are of step 2: no cut of a later step is made of them
        held.cut(4)
    for round_id in (1, 2):  # a push of a round up to the fence, whichever step: refused, never applied
        with pytest.raises(Refused) as refused:
            push(held, 3, round_id)
        assert refused.value.status == Status.FENCED
    assert held.tables[SPEC.name].digest() == at_checkpoint
    assert all(push(held, step, round_id=3) for step in (3, 4, 5))  # trained again after the cut: applied once each
    assert not push(held, 2, round_id=3)  # in the cut: applied before
    assert held.tables[SPEC.name].digest() == ahead

    held.close()
    again = shard(tmp_path / "s")  # a restarted shard: the fence and the updates since the rollback are kept
    assert again.fence == 2 and again.tables[SPEC.name].digest() == ahead
    with pytest.raises(Refused):
        push(again, 6, round_id=2)
    again.close()


def test_a_fenced_push_ends_the_workers_round_and_does_not_fail_the_job(shard, tmp_path):
    held = shard(tmp_path / "s")
    push(held, 1, round_id=1), push(held, 2, round_id=1)
    cut = held.cut(2)
    server = ShardServer(("127.0.0.1", 0), held, TOKEN)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    endpoint = f"127.0.0.1:{server.server_address[1]}"
    client = PsClient(TOKEN, lambda: None, timeout_s=10.0)
    try:
        header, _ = client.call(endpoint, {"op": "rollback", "step": 2, "digest": cut["digest"], "fence": 1})
        assert header["status"] == Status.OK
        refused, _ = client.call(endpoint, {"op": "rollback", "step": 2, "digest": "0" * 64, "fence": 1})
        assert refused["status"] == Status.NO_CUT and "SHA-256" in refused["detail"]
        routing = RoutingTable.initial(1)
        pushing = PsClient(TOKEN, lambda: RoutingTable(routing.epoch, routing.owners, [endpoint]), deadline_s=10.0)
        with pytest.raises(RoundFenced) as fenced:
            pushing.push(SPEC.name, 1, 3, 1, IDS, np.ones((3, 2), np.float32), step=3)
        assert not isinstance(fenced.value, PsError)  # ps_step.py fails the job on a PsError only
        assert pushing.push(SPEC.name, 1, 3, 2, IDS, np.ones((3, 2), np.float32), step=3).applied == 1
        pushing.close()
    finally:
        client.close()
        server.shutdown()
        server.server_close()
        held.close()


def test_a_stopping_shard_drops_requests_instead_of_answering_them_as_bad(shard, tmp_path):
    # SIGTERM (its pod deleted or evicted): the shard takes its last snapshot and closes its state
    # while connections are still open. A push then must get no answer (the worker asks again and
    # is fenced or re-routed by the rollback), never a "bad request" reply, which fails the job.
    from elastic_step.ps.state import ShardClosed

    held = shard(tmp_path / "s")
    push(held, 1, round_id=1)
    server = ShardServer(("127.0.0.1", 0), held, TOKEN)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    endpoint = f"127.0.0.1:{server.server_address[1]}"
    client = PsClient(TOKEN, lambda: None, timeout_s=5.0)
    body = {"op": "push", "table": SPEC.name, "epoch": 1, "count": 3, "task": 1, "batch_seq": 2, "attempt": 1, "step": 2}
    try:
        server.stopping.set()  # as the SIGTERM handler does, before the state is closed
        with pytest.raises((ConnectionError, OSError)):
            client.call(endpoint, {"op": "stats"})
        server.stopping.clear()
        held.close()  # a request already past that check meets the closed state
        with pytest.raises(ShardClosed):
            push(held, 2, round_id=1)
        with pytest.raises((ConnectionError, OSError)):
            client.call(endpoint, body, IDS, np.ones((3, 2), np.float32))
    finally:
        client.close()
        server.shutdown()
        server.server_close()


def test_a_rollback_the_disk_cuts_short_stops_the_shard_and_its_relaunch_finishes_it(shard, tmp_path, monkeypatch):
    """The ledger is closed and the folder half restored when a copy fails (a full disk): no push
    may be taken (LedgerFailed stops the shard process), and the relaunch finishes the restore."""
    import errno

    from elastic_step.ps.ledger import LedgerFailed

    held = shard(tmp_path / "s")
    push(held, 1, round_id=1), push(held, 2, round_id=1)
    at_checkpoint = held.tables[SPEC.name].digest()
    push(held, 3, round_id=1)
    cut = held.cut(2)
    failing_after_the_first_copy(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(LedgerFailed, match="putting back the cut of step 2 failed .*No space left"):
        held.rollback(2, cut["digest"], fence=1)
    monkeypatch.undo()
    with pytest.raises(LedgerFailed):
        push(held, 4, round_id=2)
    again = shard(tmp_path / "s")
    assert again.tables[SPEC.name].digest() == at_checkpoint and again.fence == 1
    again.close()
