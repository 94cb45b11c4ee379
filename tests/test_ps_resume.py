"""What a `--mode ps` job resumed from a checkpoint gets back, as built today (and after `scale --ps`,
the routing of its last move, which a resume finishes when its master stopped mid-way).

The checkpoint holds the dense weights of step S; the shards are not checkpointed with it. A
resume keeps the shards' folders, so the tables hold every update acknowledged before the master
stopped, including the minibatches trained after step S. The workers re-train those from S: the
shards drop their pushes (the keys were applied), so each row is still updated exactly once per
minibatch, while the dense weights take those minibatches' updates again, against tables that
already hold them. Tables and dense weights are therefore not of one step after a resume; a
checkpoint consistent across both (one snapshot generation per checkpoint) is not built yet.
Any start other than a resume empties the tables.
"""

from __future__ import annotations

import contextlib
import types

import numpy as np
import pytest

from elastic_step.master.ps_shards import start_ps_shards
from elastic_step.protocol import TrainingMode
from elastic_step.ps.client import PsClient
from elastic_step.ps.routing import RoutingTable

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
    config = types.SimpleNamespace(mode=TrainingMode.PS, model_def=str(tmp_path / "model.py"), job_dir=str(tmp_path / "job"),
                                   ps_shards=1)

    @contextlib.contextmanager
    def started(resuming: bool):
        with contextlib.ExitStack() as running:  # as the master's: the shards get SIGTERM (a last snapshot) at its end
            routing, monitor = start_ps_shards(config, str(tmp_path / "token"), running, resuming)
            client = PsClient(TOKEN, lambda: RoutingTable.from_json(routing))
            running.callback(client.close)
            yield client, monitor

    return started


def push(client: PsClient, task: int, seq: int):
    return client.push("resume_t", task, seq, 0, IDS, np.ones((2, 2), np.float32))


def test_a_resume_keeps_every_acknowledged_update_and_drops_the_retrained_minibatches(job):
    with job(resuming=False) as (client, _):
        before = client.pull("resume_t", IDS).copy()
        assert push(client, task=1, seq=0).applied == 1  # trained before the checkpoint
        assert push(client, task=2, seq=0).applied == 1  # after it: the master then stops
        trained = client.pull("resume_t", IDS).copy()
    np.testing.assert_allclose(trained, before - 2.0, rtol=1e-5)  # SGD, lr 1, two pushes of ones

    with job(resuming=True) as (client, monitor):
        assert [(r["rows"], r["pushes"]) for r in monitor.rows()] == [(2, 2)]
        np.testing.assert_allclose(client.pull("resume_t", IDS), trained)  # not rolled back to the checkpoint
        reply = push(client, task=2, seq=0)  # the minibatch re-trained after the checkpoint
        assert (reply.applied, reply.duplicate) == (0, 1)
        np.testing.assert_allclose(client.pull("resume_t", IDS), trained)
        assert push(client, task=3, seq=0).applied == 1  # training goes on

    with job(resuming=False) as (client, monitor):  # a fresh start: empty tables
        assert [(r["rows"], r["pushes"]) for r in monitor.rows()] == [(0, 0)]


def test_a_resume_after_scale_ps_runs_the_last_routing_and_finishes_a_move_left_half_done(job):
    ids = np.arange(200, dtype=np.int64)
    with job(resuming=False) as (client, monitor):
        client.push("resume_t", 1, 0, 0, ids, np.ones((len(ids), 2), np.float32))
        assert monitor.scale(2)["moved"] == 64  # half the virtual shards go to the new shard
        client.push("resume_t", 1, 1, 0, ids, np.ones((len(ids), 2), np.float32))  # re-routed from the shards' refusal
        trained = client.pull("resume_t", ids).copy()
        # The master dies mid-way through a move to 3 shards: only shard 0 took the new routing.
        grown = client.routing.resized(3, client.routing.endpoints + ["127.0.0.1:1"])
        assert client.call(client.routing.endpoints[0], {"op": "adopt", "routing": grown.to_json()})[0]["epoch"] == 3

    with job(resuming=True) as (client, monitor):
        assert client.routing.epoch == 3 and len(monitor.rows()) == 3  # the move was finished
        np.testing.assert_allclose(client.pull("resume_t", ids), trained)  # every row arrived, none twice
        reply = client.push("resume_t", 1, 1, 0, ids, np.ones((len(ids), 2), np.float32))
        assert (reply.applied, reply.duplicate) == (0, 3)  # the keys moved with the rows
        np.testing.assert_allclose(client.pull("resume_t", ids), trained)
        assert sum(r["rows"] for r in monitor.rows()) == len(ids)  # each row on one shard only
