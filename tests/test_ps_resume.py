"""What a `--mode ps` job resumed from a checkpoint gets back: real shard processes started and
stopped as the master does, the checkpoint recorded as the master records it.

A checkpoint of step S is one cut across the shards (master/ps_checkpoints.py, ps/cuts.py): each
shard's tables as they were after exactly the pushes of steps <= S, though the job went on
pushing after S before the master stopped. A resume starts every shard from that cut: the tables
hash as they did at the checkpoint, and the minibatches trained after S, which the workers
train again with the dense weights of S, are applied again, once. A checkpoint whose step a
shard cannot cut is not taken (one line): the master records no CHECKPOINT event for it, and a
stop waiting on it waits for the next one instead of ending STOPPED; a resume whose cut is not the recorded one stops
in one line. Any start other than a resume empties the tables.

After `scale --ps`, a resume from a checkpoint without a cut runs the routing of the last move,
and finishes that move when its master stopped mid-way; the move's start and finish are events.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import types

import numpy as np
import pytest

from elastic_step import defaults
from elastic_step.cli.render import describe_event
from elastic_step.errors import ConfigError
from elastic_step.master.events import EventLog
from elastic_step.master.ps_checkpoints import PS_CUT, PsCheckpoints
from elastic_step.master.ps_shards import start_ps_shards
from elastic_step.protocol import JobState, TrainingMode
from elastic_step.ps import local, moves
from elastic_step.ps.client import PsClient
from elastic_step.ps.embedding import frozen_table
from elastic_step.ps.routing import RoutingTable
from lost_release import move_losing_a_release, move_losing_a_request

TOKEN = "ps-resume-token"
MODEL = '''
import torch
from elastic_step.ps.torch_embedding import PsEmbedding

def model():
    return torch.nn.Sequential(PsEmbedding("resume_t", 2, optimizer="sgd", lr=1.0))

def loss(outputs, labels):
    return torch.nn.functional.mse_loss(outputs, labels)

def optimizer(net):
    return torch.optim.SGD(net.parameters(), lr=0.1)
'''
IDS = np.array([3, 8], np.int64)


@pytest.fixture
def job(tmp_path):
    (tmp_path / "model.py").write_text(MODEL)
    (tmp_path / "token").write_text(TOKEN)
    events = EventLog(None)

    @contextlib.contextmanager
    def started(resuming: bool, cut: dict | None = None, shards: int = 1):
        config = types.SimpleNamespace(mode=TrainingMode.PS, model_def=str(tmp_path / "model.py"), job_dir=str(tmp_path / "job"),
                                       ps_shards=shards, checkpoint_steps=2, ps_table_limit_mb=defaults.PS_TABLE_LIMIT_MB,
                                       backend="local", ps_memory=None, worker_memory=None)
        with contextlib.ExitStack() as running:  # as the master's: the shards get SIGTERM (a last snapshot) at its end
            routing, monitor = start_ps_shards(config, str(tmp_path / "token"), running, resuming, cut=cut, events=events)
            client = PsClient(TOKEN, lambda: RoutingTable.from_json(routing))
            running.callback(client.close)
            yield client, monitor

    started.events = events
    return started


def push(client: PsClient, task: int, seq: int, step: int | None = None):
    return client.push("resume_t", task, seq, 0, IDS, np.ones((2, 2), np.float32), step=step)


def digests(client: PsClient) -> list[str]:
    """Each shard's hash of its part of the table (rows, optimizer slots, update counters)."""
    return [client.call(endpoint, {"op": "digest", "table": "resume_t"})[0]["digest"] for endpoint in client.routing.endpoints]


def test_a_resume_puts_every_shard_back_to_the_checkpoints_cut_and_re_applies_what_came_after(job, caplog):
    with job(resuming=False, shards=2) as (client, monitor):
        before = client.pull("resume_t", IDS).copy()
        assert push(client, task=1, seq=0, step=1).applied == 2  # IDS: on both shards
        assert push(client, task=1, seq=1, step=2).applied == 2
        at_checkpoint, rows_at_checkpoint = digests(client), client.pull("resume_t", IDS).copy()
        assert push(client, task=2, seq=0, step=3).applied == 2  # after the checkpoint's step: each shard cuts first
        trained = client.pull("resume_t", IDS).copy()
        recorded = []
        taking = PsCheckpoints(monitor, lambda *checkpoint: recorded.append(checkpoint))
        client.call(client.routing.endpoints[1], {"op": "snapshot"})  # as one every 1000 pushes would be
        with caplog.at_level(logging.WARNING, logger="elastic_step.master"):
            assert taking(1, 0, b"dense", {"current_epoch": 0}) is False  # not a multiple of 2, and shard 1's ledger no longer reaches back
        assert not recorded and "checkpoint of step 1 not taken" in caplog.text and "shard 1 took a snapshot after step 1" in caplog.text
        assert taking(2, 0, b"dense", {"current_epoch": 0}) is True  # rank 0's checkpoint of step 2, handed over now
        refusing = PsCheckpoints(monitor, lambda *checkpoint: False)  # a record that could not keep it (its cut's copy)
        assert refusing(2, 0, b"dense", {"current_epoch": 0}) is False
        (step, _, _, ledger), = recorded
        cut = ledger[PS_CUT]
        assert step == 2 and cut["step"] == 2 and len(cut["digests"]) == 2
    np.testing.assert_allclose(trained, before - 3.0, rtol=1e-5)  # SGD, lr 1, three pushes of ones

    with job(resuming=True, cut=cut, shards=2) as (client, monitor):
        assert digests(client) == at_checkpoint  # the tables of step 2, not those the master stopped with
        np.testing.assert_allclose(client.pull("resume_t", IDS), rows_at_checkpoint)
        assert push(client, task=1, seq=1, step=2).duplicate == 2  # trained before the cut: applied once already
        assert push(client, task=2, seq=0, step=3).applied == 2  # re-trained after it: applied again, once
        np.testing.assert_allclose(client.pull("resume_t", IDS), trained)

    with pytest.raises(ConfigError, match="shard 1's cut, but .* not the one the checkpoint recorded"):
        with job(resuming=True, cut={**cut, "digests": [cut["digests"][0], "0" * 64]}, shards=2):
            pass

    with job(resuming=False) as (client, monitor):  # a fresh start: empty tables
        assert [(r["rows"], r["pushes"]) for r in monitor.rows()] == [(0, 0)]


def test_a_resume_after_scale_ps_runs_the_last_routing_and_finishes_a_move_left_half_done(job, caplog):
    ids = np.arange(200, dtype=np.int64)
    with job(resuming=False) as (client, monitor):
        client.push("resume_t", 1, 0, 0, ids, np.ones((len(ids), 2), np.float32))
        assert monitor.scale(2)["moved"] == 64  # half the virtual shards go to the new shard
        started, finished = job.events.of("ps_scale_started"), job.events.of("ps_scale_finished")  # what get -e shows
        assert [(e["shards_from"], e["shards_to"]) for e in started] == [(1, 2)]
        assert finished[0]["ok"] and 0 < finished[0]["rows_moved"] < finished[0]["rows_total"] == len(ids)
        assert finished[0]["pause_max_s"] >= 0 and finished[0]["routing_epoch"] == 2
        shown = describe_event(finished[0])
        assert f"rows_moved={finished[0]['rows_moved']}" in shown and "pause_max_s=" in shown and not shown.endswith("...")
        client.push("resume_t", 1, 1, 0, ids, np.ones((len(ids), 2), np.float32))  # re-routed from the shards' refusal
        trained = client.pull("resume_t", ids).copy()
        # The master dies mid-way through a move to 3 shards: only shard 0 took the new routing.
        grown = client.routing.resized(3, client.routing.endpoints + ["127.0.0.1:1"])
        assert client.call(client.routing.endpoints[0], {"op": "adopt", "routing": grown.to_json()})[0]["epoch"] == 3

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="elastic_step.master"), job(resuming=True) as (client, monitor):
        assert client.routing.epoch == 3 and len(monitor.rows()) == 3  # the move was finished
        assert caplog.text.count("the move to routing epoch 3 was left mid-way") == 1  # said once, at the resume
        np.testing.assert_allclose(client.pull("resume_t", ids), trained)  # every row arrived, none twice
        reply = client.push("resume_t", 1, 1, 0, ids, np.ones((len(ids), 2), np.float32))
        assert (reply.applied, reply.duplicate) == (0, 3)  # the keys moved with the rows
        np.testing.assert_allclose(client.pull("resume_t", ids), trained)
        assert sum(r["rows"] for r in monitor.rows()) == len(ids)  # each row on one shard only


def test_a_checkpoint_without_a_cut_is_no_checkpoint_and_a_stop_waits_for_the_next_one():
    from test_stop import started, train

    state, handed = started()
    # As PsCheckpoints: False when the shards had no cut of the step (here step 1's)
    state.checkpoints.on_checkpoint = lambda step, *rest: handed.append(step) or step != 1
    state.request_stop()
    train(state, 1, checkpoint=True)
    assert not state.checkpoint_now
    train(state, 2)
    state.tick()  # step 1 is final and handed over, but not taken
    assert handed == [1] and state.state == JobState.RUNNING and not state.events.of("checkpoint")
    assert state.checkpoint_now  # rank 0 is asked for another checkpoint
    train(state, 3, checkpoint=True)
    train(state, 4)
    state.tick()
    assert handed == [1, 3] and state.state == JobState.STOPPED
    assert [e["step"] for e in state.events.of("checkpoint")] == [3] and state.events.of("stopped")[0]["step"] == 3


def test_a_cut_the_shards_launcher_cannot_keep_is_no_checkpoint():
    from elastic_step.master.ps_shards import keeping_cuts

    def keep_cut(cut):
        raise OSError("the checkpoint store is full")

    monitor = types.SimpleNamespace(supervisor=types.SimpleNamespace(keep_cut=keep_cut))
    recording = keeping_cuts(monitor, lambda *checkpoint: None)
    assert recording(4, 0, b"", {PS_CUT: {"step": 4}}) is False  # so PsCheckpoints counts no checkpoint


def test_a_scale_whose_release_failed_is_finished_at_the_jobs_end_so_the_model_holds_the_trained_rows(job, monkeypatch):
    """The move's rows arrived and training went on under the new routing, but one shard never
    heard the release and the master gave up: the old owner still holds stale copies of what it
    gave away. The job's end finishes the move first, so the final model (what is evaluated and
    logged) takes every row from the shard that trained it last, and the routing it names."""
    ids = np.arange(200, dtype=np.int64)
    with job(resuming=False) as (client, monitor):
        client.push("resume_t", 1, 0, 0, ids, np.ones((len(ids), 2), np.float32))
        monkeypatch.setattr(local, "move", move_losing_a_release())
        with pytest.raises(ValueError, match="the move to 2 shards did not finish"):
            monitor.scale(2)
        monkeypatch.undo()
        with pytest.raises(ValueError, match="did not finish .*: stop the job and resume it .* then scale"):
            monitor.scale(2)  # a second move would start from the routing the shards have left
        client.push("resume_t", 1, 1, 0, ids, np.ones((len(ids), 2), np.float32))  # re-routed by the shards' refusals
        trained = client.pull("resume_t", ids).copy()
    frozen_ids, frozen_rows = frozen_table("resume_t")
    assert np.array_equal(frozen_ids, ids)  # every row once
    np.testing.assert_allclose(frozen_rows, trained)  # as trained last, not the old owner's copies of before the move


def test_a_move_left_mid_way_is_redone_at_the_jobs_end_and_said_once(job, monkeypatch, caplog):
    """A scale whose import the new shard never answered leaves rows on their way: the job's end
    does the whole move again before the tables are read, and says so in one line (its epoch,
    and that the move was left mid-way); the model holds every row as trained."""
    ids = np.arange(200, dtype=np.int64)
    with caplog.at_level(logging.WARNING, logger="elastic_step.master"):
        with job(resuming=False) as (client, monitor):
            client.push("resume_t", 1, 0, 0, ids, np.ones((len(ids), 2), np.float32))
            trained = client.pull("resume_t", ids).copy()
            monkeypatch.setattr(local, "move", move_losing_a_request("import", shard=1))  # shard 1 gains rows in 1 -> 2
            with pytest.raises(ValueError, match="the move to 2 shards did not finish"):
                monitor.scale(2)
            monkeypatch.undo()
    said = [r.getMessage() for r in caplog.records if "routing epoch 2" in r.getMessage()]
    assert len(said) == 1 and "left mid-way" in said[0] and "before the tables are read" in said[0], said
    frozen_ids, frozen_rows = frozen_table("resume_t")
    assert np.array_equal(frozen_ids, ids)  # every row once
    np.testing.assert_allclose(frozen_rows, trained)


def test_scales_that_finished_leave_nothing_to_finish_at_the_jobs_end(job, caplog):
    """3 -> 2 -> 1 shards: the removed shards' folders keep the routing they had when they left,
    which is no unfinished move: the job's end says nothing of one and the model is whole."""
    ids = np.arange(200, dtype=np.int64)
    with caplog.at_level(logging.WARNING, logger="elastic_step.master"):
        with job(resuming=False, shards=3) as (client, monitor):
            client.push("resume_t", 1, 0, 0, ids, np.ones((len(ids), 2), np.float32))
            monitor.scale(2)
            monitor.scale(1)
            client.push("resume_t", 1, 1, 0, ids, np.ones((len(ids), 2), np.float32))
            trained = client.pull("resume_t", ids).copy()
    assert "move" not in caplog.text
    frozen_ids, frozen_rows = frozen_table("resume_t")
    assert np.array_equal(frozen_ids, ids)
    np.testing.assert_allclose(frozen_rows, trained)


def test_the_jobs_end_waits_for_a_scale_under_way_before_it_stops_the_shards(job, monkeypatch):
    """A scale --ps asked for just before the job ends is let finish: the shards are stopped
    and their tables read after it, not beside it."""
    ids = np.arange(200, dtype=np.int64)

    def slow_move(*args, **kwargs):
        time.sleep(1.0)  # the job's end comes meanwhile
        return moves.move(*args, **kwargs)

    monkeypatch.setattr(local, "move", slow_move)
    results = []
    with job(resuming=False) as (client, monitor):
        client.push("resume_t", 1, 0, 0, ids, np.ones((len(ids), 2), np.float32))
        trained = client.pull("resume_t", ids).copy()
        scaling = threading.Thread(target=lambda: results.append(monitor.scale(2)))
        scaling.start()
        time.sleep(0.2)
    scaling.join()
    assert results and results[0]["moved"] == 64  # it finished, before the shards were stopped
    frozen_ids, frozen_rows = frozen_table("resume_t")
    assert np.array_equal(frozen_ids, ids)
    np.testing.assert_allclose(frozen_rows, trained)
