"""A --mode ps job's end: the master's validations read the live shards, and the shards stop
while MLflow's queue may still hold one. Seen on the cluster stand-in: such a validation waited
out its pulls' minute, and the uploader retried it for up to ten, while the job's final
evaluation waited behind it for the model."""

import logging
import socket
import threading
import time

import numpy as np
import pytest

from elastic_step.master.ps_shards import LiveRows
from elastic_step.ps.api import ShardUnavailable
from elastic_step.ps.client import PsClient
from elastic_step.ps.routing import RoutingTable
from elastic_step.tracking.recorder import TrainingRecorder


def stopped_shard() -> str:
    """An address where a shard was: nothing listens there any more (connections refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_once_the_shards_stop_a_pull_fails_at_once_instead_of_retrying_for_its_deadline():
    endpoint = stopped_shard()
    live = LiveRows(PsClient("token", lambda: RoutingTable.initial(1, [endpoint]), deadline_s=60.0))
    live.close()
    started = time.monotonic()
    with pytest.raises(ShardUnavailable):
        live.pull("table", np.arange(3, dtype=np.int64))
    assert time.monotonic() - started < 2.0


def test_a_validation_that_meets_stopped_shards_is_skipped_not_retried(monkeypatch, caplog):
    def evaluate(*args):
        raise ShardUnavailable("3 ids unanswered after 0 s; are the shards running?")

    monkeypatch.setattr("elastic_step.evaluation.evaluate", evaluate)
    validated = []
    recorder = object.__new__(TrainingRecorder)  # only what _validate touches
    recorder.trainer_lock = threading.Lock()
    recorder.trainer = type("Trainer", (), {"load_state_bytes": lambda self, state: None})()
    recorder.model_def = recorder.manifest = None
    recorder.checkpoints = type("Store", (), {"validated": lambda self, step, metrics: validated.append(step)})()
    with caplog.at_level(logging.WARNING, logger="elastic_step.tracking"):
        recorder._validate(40, b"state")  # returns: the uploader does not retry it
    assert validated == []
    assert "validation of the checkpoint of step 40 skipped" in caplog.text and "shards running" in caplog.text
