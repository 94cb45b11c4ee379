"""A --mode ps job's end: the master's validations read the live shards, and the shards stop
while MLflow's queue may still hold one. Seen on the cluster stand-in: such a validation waited
out its pulls' minute, and the uploader retried it for up to ten, while the job's final
evaluation waited behind it for the model. A shard that is only away (relaunching) is another
matter: that validation is tried again."""

import logging
import socket
import threading
import time

import numpy as np
import pytest

from elastic_step.master.ps_rows import LiveRows
from elastic_step.ps.api import ShardsStopped, ShardUnavailable
from elastic_step.ps.client import PsClient
from elastic_step.ps.routing import RoutingTable
from elastic_step.tracking.recorder import TrainingRecorder


def stopped_shard() -> str:
    """An address where a shard was: nothing listens there any more (connections refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_once_the_shards_stop_a_pull_under_way_ends_at_its_next_retry_and_a_later_one_at_once():
    endpoint = stopped_shard()
    live = LiveRows(PsClient("token", lambda: RoutingTable.initial(1, [endpoint]), deadline_s=60.0))
    ended = []

    def validation():
        try:
            live.pull("table", np.arange(3, dtype=np.int64))
        except ShardUnavailable as exc:
            ended.append((time.monotonic(), exc))

    pulling = threading.Thread(target=validation)
    pulling.start()
    time.sleep(0.5)  # retrying: the shard refuses its connections
    closed = time.monotonic()
    live.close()
    pulling.join(10)
    assert ended and ended[0][0] - closed < 2.0 and isinstance(ended[0][1], ShardsStopped), ended
    started = time.monotonic()
    with pytest.raises(ShardsStopped):
        live.pull("table", np.arange(3, dtype=np.int64))
    assert time.monotonic() - started < 0.5


@pytest.mark.parametrize("error, skipped", [(ShardsStopped("the parameter-server shards have stopped"), True),
                                            (ShardUnavailable("3 ids unanswered after 60 s"), False)])
def test_a_validation_that_meets_stopped_shards_is_skipped_and_one_that_meets_an_absent_shard_is_retried(
        monkeypatch, caplog, error, skipped):
    def evaluate(*args):
        raise error

    monkeypatch.setattr("elastic_step.evaluation.evaluate", evaluate)
    validated = []
    recorder = object.__new__(TrainingRecorder)  # only what _validate touches
    recorder.trainer_lock = threading.Lock()
    recorder.trainer = type("Trainer", (), {"load_state_bytes": lambda self, state: None})()
    recorder.model_def = recorder.manifest = None
    recorder.checkpoints = type("Store", (), {"validated": lambda self, step, metrics: validated.append(step)})()
    with caplog.at_level(logging.WARNING, logger="elastic_step.tracking"):
        if skipped:
            recorder._validate(40, b"state")  # returns: the uploader does not retry it
            assert "validation of the checkpoint of step 40 skipped" in caplog.text
        else:  # raised: the uploader tries it again, as when MLflow is away
            with pytest.raises(ShardUnavailable):
                recorder._validate(40, b"state")
    assert validated == []
