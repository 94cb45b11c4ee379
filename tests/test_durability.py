"""What survives a crash, a hostile job folder, a refusing MLflow and a vanished master: files
written whole and never through a planted link, the audit and checkpoints on disk before a commit
names them, a damaged newest checkpoint skipped for an older one, MLflow's refusals failing the
job at once, validation never sharing the trainer with the final evaluation, no password of the
tracking URI anywhere, and workers that leave a dead master."""

from __future__ import annotations

import json
import os
import socket
import stat
import time

import pytest

from conftest import MODEL, cli

from elastic_step.audit import read_audit, start_audit
from elastic_step.durable import write_atomic, write_private


# -- files written whole, never through a link -----------------------------------------------------
def test_private_and_atomic_files_replace_a_planted_link_instead_of_writing_through_it(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    token = tmp_path / "token"
    token.symlink_to(victim)
    write_private(str(token), "secret-token")
    assert victim.read_text() == "precious"
    assert not token.is_symlink() and token.read_text() == "secret-token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    result = tmp_path / "result.json"
    result.symlink_to(victim)
    write_atomic(str(result), '{"ok": true}')
    assert victim.read_text() == "precious" and json.loads(result.read_text()) == {"ok": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json", "token", "victim"]  # no temp files left


def test_a_failed_atomic_write_leaves_the_old_file_whole(tmp_path, monkeypatch):
    path = tmp_path / "master.json"
    path.write_text('{"url": "old"}')

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        write_atomic(str(path), '{"url": "new"}')
    assert path.read_text() == '{"url": "old"}'
    assert [p.name for p in tmp_path.iterdir()] == ["master.json"]


def test_the_token_file_is_created_private_exclusively_and_never_chmodded_after(tmp_path, monkeypatch):
    opened = []
    real_open = os.open

    def spy_open(path, flags, mode=0o777, *args, **kwargs):
        opened.append((str(path), flags, mode))
        return real_open(path, flags, mode, *args, **kwargs)

    def no_chmod(*args, **kwargs):
        raise AssertionError("the token was readable until a chmod")

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "chmod", no_chmod)
    write_private(str(tmp_path / "token"), "t" * 43)
    created = [(flags, mode) for path, flags, mode in opened if flags & os.O_CREAT]
    assert created, opened
    for flags, mode in created:
        assert flags & os.O_EXCL and flags & os.O_NOFOLLOW and mode == 0o600


# -- the audit file ---------------------------------------------------------------------------------
LINE = {"epoch": 0, "shard": "train-00000.parquet", "start": 0, "count": 8, "step": 1}


def test_a_torn_last_audit_line_is_skipped_by_readers_and_cut_before_a_resume_appends(tmp_path):
    path = tmp_path / "audit.jsonl"
    second = dict(LINE, start=8, step=2)
    path.write_text(json.dumps(LINE) + "\n" + json.dumps(second) + "\n" + '{"epoch": 0, "shard": "train-0')
    assert read_audit(str(path)) == [LINE, second]
    start_audit(str(path), resuming=True)
    assert path.read_text() == json.dumps(LINE) + "\n" + json.dumps(second) + "\n"
    with open(path, "a") as f:  # what the ledger then appends
        f.write(json.dumps({"resume_from_step": 1}) + "\n")
    assert read_audit(str(path)) == [LINE]


def test_a_whole_last_line_without_its_newline_is_kept_and_ended(tmp_path):
    path = tmp_path / "audit.jsonl"
    path.write_text(json.dumps(LINE))
    start_audit(str(path), resuming=True)
    assert path.read_text() == json.dumps(LINE) + "\n"


def test_a_damaged_line_inside_the_audit_is_an_error_naming_it(tmp_path):
    path = tmp_path / "audit.jsonl"
    path.write_text(json.dumps(LINE) + "\n" + "garbage\n" + json.dumps(LINE) + "\n")
    with pytest.raises(ValueError, match="line 2"):
        read_audit(str(path))


def test_a_new_job_starts_its_audit_empty(tmp_path):
    path = tmp_path / "audit.jsonl"
    path.write_text(json.dumps(LINE) + "\n")
    start_audit(str(path), resuming=False)
    assert path.read_text() == ""


# -- checkpoints: on disk before the commit, damaged ones skipped ----------------------------------------
def sqlite_tracker(tmp_path, job="job"):
    from elastic_step.tracking.run import RunTracker, connect

    client = connect(f"sqlite:///{tmp_path / 'mlflow.db'}", str(tmp_path))
    tracker = RunTracker(client, "exp", job, str(tmp_path / "artifacts"))
    tracker.start(resume=False)
    return tracker


def test_checkpoint_files_and_the_audit_are_fsynced_before_the_commit_tag(tmp_path, monkeypatch):
    from elastic_step.tracking.checkpoints import Checkpoint, CheckpointStore

    tracker = sqlite_tracker(tmp_path)
    audit = tmp_path / "audit.jsonl"
    audit.write_text(json.dumps(LINE) + "\n")
    order = []
    real_fsync = os.fsync

    def fsync(fd):
        try:
            order.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:
            order.append(("fsync", "?"))
        return real_fsync(fd)

    real_log_batch = tracker.client.log_batch

    def log_batch(run_id, metrics=(), params=(), tags=()):
        if any(t.key == "elastic_step.checkpoint" for t in tags):
            order.append(("commit", ""))
        return real_log_batch(run_id, metrics=metrics, params=params, tags=tags)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(tracker.client, "log_batch", log_batch)
    store = CheckpointStore(tracker, str(tmp_path / "checkpoints"), keep=3, sync_before_commit=[str(audit)])
    store.save(Checkpoint(5, 0, b"state" * 100, {"current_epoch": 0, "epochs": {}}))
    assert tracker.uploader.drain(60)
    commit = order.index(("commit", ""))
    synced = {os.path.basename(path) for what, path in order[:commit] if what == "fsync"}
    assert {"audit.jsonl", "state.bin", "ledger.json", "meta.json"} <= synced, order


def checkpoint_artifact_dir(tracker, step):
    run = tracker.client.get_run(tracker.run_id)
    root = run.info.artifact_uri.replace("file://", "")
    return os.path.join(root, "checkpoints", f"step-{step:06d}")


@pytest.mark.parametrize("damage", ["truncated state", "missing ledger", "folder gone"])
def test_latest_falls_back_to_the_newest_checkpoint_that_is_whole(tmp_path, damage, capsys):
    from elastic_step.tracking.checkpoints import Checkpoint, CheckpointStore

    tracker = sqlite_tracker(tmp_path)
    store = CheckpointStore(tracker, str(tmp_path / "checkpoints"), keep=3)
    for step in (10, 20, 30):
        store.save(Checkpoint(step, 0, f"state of {step}".encode() * 50, {"current_epoch": 0, "epochs": {"0": [[0, 0, 64, step]]}}))
    assert tracker.uploader.drain(60)
    newest = checkpoint_artifact_dir(tracker, 30)
    if damage == "truncated state":
        with open(os.path.join(newest, "state.bin"), "r+b") as f:
            f.truncate(10)
    elif damage == "missing ledger":
        os.remove(os.path.join(newest, "ledger.json"))
    else:
        import shutil

        shutil.rmtree(newest)
    found = CheckpointStore(tracker, str(tmp_path / "elsewhere"), keep=3).latest()
    assert found is not None and found.step == 20 and found.state == b"state of 20" * 50
    assert found.ledger["epochs"]["0"][0][3] == 20
    assert "using the older step-000020" in capsys.readouterr().err


def test_latest_is_a_clear_error_when_no_kept_checkpoint_is_whole(tmp_path):
    from elastic_step.tracking.checkpoints import Checkpoint, CheckpointStore
    from elastic_step.tracking.run import TrackingError

    tracker = sqlite_tracker(tmp_path)
    store = CheckpointStore(tracker, str(tmp_path / "checkpoints"), keep=2)
    for step in (10, 20):
        store.save(Checkpoint(step, 0, b"x" * 100, {"current_epoch": 0, "epochs": {}}))
    assert tracker.uploader.drain(60)
    for step in (10, 20):
        os.remove(os.path.join(checkpoint_artifact_dir(tracker, step), "state.bin"))
    with pytest.raises(TrackingError, match="none of them can be read"):
        store.latest()


# -- MLflow refusing a record ------------------------------------------------------------------------------
def test_a_record_mlflow_rejects_fails_at_once_and_the_run_is_marked_failed(tmp_path):
    tracker = sqlite_tracker(tmp_path)
    later = []
    started = time.monotonic()
    tracker.log_metric("top@5", 0.9, 1)
    tracker.flush_metrics()
    tracker.set_tag("after", "x")
    tracker.uploader.submit("a later checkpoint", lambda: later.append(1))
    assert tracker.uploader.drain(30) is False
    assert time.monotonic() - started < 10
    error = tracker.uploader.error
    assert error and "\n" not in error and "top@5" in error and "rejected" in error
    assert later == []  # nothing runs after a permanent failure: the job is failing
    assert tracker.finish(ok=True) is False
    assert tracker.client.get_run(tracker.run_id).info.status == "FAILED"


def test_mlflow_being_away_is_retried_then_given_up_after_the_bound(tmp_path):
    from mlflow.exceptions import MlflowException

    from elastic_step.tracking.uploader import Uploader

    attempts = []

    def flaky():
        attempts.append(time.monotonic())
        if len(attempts) < 3:
            raise MlflowException("API request to http://u:hunter2@mlflow/api failed with exception ConnectionError")

    uploader = Uploader(max_backoff_s=0.1, max_retry_s=5)
    uploader.submit("flaky", flaky)
    assert uploader.drain(10) is True and len(attempts) == 3 and uploader.error is None

    def away():
        raise ConnectionError("connection refused")

    bounded = Uploader(max_backoff_s=0.1, max_retry_s=1.0)
    started = time.monotonic()
    bounded.submit("checkpoint step-000010", away)
    assert bounded.drain(10) is False
    assert time.monotonic() - started < 5
    assert "did not accept checkpoint step-000010 for 1s" in bounded.error


def test_uploader_errors_carry_no_password(tmp_path):
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

    from elastic_step.tracking.uploader import Uploader

    def rejected():
        raise MlflowException("API request to http://alice:hunter2@mlflow:5000/api/2.0/x failed", error_code=INVALID_PARAMETER_VALUE)

    uploader = Uploader()
    uploader.submit("log params", rejected)
    assert uploader.drain(10) is False
    assert "hunter2" not in uploader.error and "alice:***@mlflow" in uploader.error


def test_a_metric_name_mlflow_rejects_is_a_clear_error_before_training(tmp_path, digits):
    model = tmp_path / "top_at_5.py"
    model.write_text(
        "from elastic_step.model_zoo.digits_torch import feed, loss, model, optimizer  # noqa: F401\n"
        "def metrics():\n"
        "    return {'top@5': lambda outputs, labels: 1.0}\n"
    )
    done = cli("train", "--model-def", str(model), "--data", digits, "--job-dir", str(tmp_path / "job"), "--no-progress",
               timeout=180)
    assert done.returncode != 0
    message = done.stderr.strip().splitlines()[-1]
    assert "'top@5'" in message and "metrics()" in message and "rename" in message
    assert not (tmp_path / "job" / "logs").exists()  # no worker started


# -- validation has the trainer to itself ------------------------------------------------------------------
def test_epoch_validation_and_the_final_evaluation_never_share_the_trainers_weights(tmp_path, digits, monkeypatch):
    from mlflow.tracking import MlflowClient

    from elastic_step.config import TrainConfig
    from elastic_step.data.manifest import load_manifest
    from elastic_step.evaluation import evaluate
    from elastic_step.frameworks.model_def import load_model_definition
    from elastic_step.frameworks.registry import build_trainer
    from elastic_step.tracking.recorder import TrainingRecorder

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = TrainConfig(model_def=MODEL, data=digits, job_dir=str(tmp_path / "job"), mlflow_uri=uri, progress=False)
    manifest = load_manifest(digits)
    model_def = load_model_definition(MODEL)
    checkpoint_trainer = build_trainer(model_def, seed=1)  # weights A: what the epoch's checkpoint holds
    final_trainer = build_trainer(model_def, seed=2)  # weights B: the final model
    state_a, model_b = checkpoint_trainer.state_bytes(), final_trainer.model_bytes()
    expected_val = evaluate(checkpoint_trainer, model_def, manifest, "val")
    expected_test = evaluate(final_trainer, model_def, manifest, "test")

    shared = build_trainer(model_def, seed=0)
    real_predict = shared.predict

    def slow_predict(features):  # widen the window in which another thread could swap weights
        time.sleep(0.3)
        return real_predict(features)

    monkeypatch.setattr(shared, "predict", slow_predict)
    recorder = TrainingRecorder(config, manifest, shared, model_def)
    recorder.on_checkpoint(7, 1, state_a, {"current_epoch": 1, "epochs": {}})  # epoch 1 done: validate on the uploader
    time.sleep(0.05)
    test_metrics = recorder.evaluate_model(model_b, "test")  # meanwhile, the main thread
    assert recorder.tracker.uploader.drain(60)
    assert test_metrics["loss"] == pytest.approx(expected_test["loss"], rel=1e-6)
    logged = MlflowClient(uri).get_run(recorder.run_id).data.metrics
    assert logged["val_loss"] == pytest.approx(expected_val["loss"], rel=1e-6)
    recorder.finish(False, config.job_dir)


# -- a worker whose master is gone ---------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_worker_client_gives_up_within_seconds_when_the_master_address_refuses(monkeypatch):
    from elastic_step.worker.client import MasterClient, MasterGone

    client = MasterClient(f"http://127.0.0.1:{free_port()}", "token", master_timeout_s=30.0)
    started = time.monotonic()
    with pytest.raises(MasterGone, match="refuses connections"):
        client.call("POST", "/heartbeat", {"worker_id": "w"})
    assert time.monotonic() - started < 4.0


def test_a_silent_master_is_given_the_whole_master_timeout_and_no_more():
    from elastic_step.worker.client import MasterClient, MasterGone

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # connections are accepted by the kernel, and nobody ever answers
    try:
        client = MasterClient(f"http://127.0.0.1:{silent.getsockname()[1]}", "token", master_timeout_s=4.0)
        started = time.monotonic()
        with pytest.raises(MasterGone, match="unreachable"):
            client.call("POST", "/heartbeat", {"worker_id": "w"})
        took = time.monotonic() - started
        assert 4.0 <= took < 6.5, took
    finally:
        silent.close()
