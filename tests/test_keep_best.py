"""`--keep-best METRIC[:min|max]`: besides the newest checkpoints, the one with the best
validation metric is kept, named by a run tag, readable after the run and across `--resume`."""

from __future__ import annotations

import os

import pytest

from elastic_step.tracking.checkpoints import BEST_TAG, BestRule, Checkpoint, CheckpointStore, parse_best_rule

from test_durability import checkpoint_artifact_dir, sqlite_tracker


def save_and_validate(store, tracker, step, metrics):
    store.save(Checkpoint(step, step // 10, f"state of {step}".encode() * 20, {"current_epoch": 0, "epochs": {}}))
    # validation runs on the uploader's thread after the checkpoint's commit, as the recorder does it
    tracker.uploader.submit(f"validation of {step}", lambda: store.validated(step, metrics))
    assert tracker.uploader.drain(60)


def test_the_best_checkpoint_outlives_the_newest_ones_and_can_be_read_back(tmp_path):
    tracker = sqlite_tracker(tmp_path)
    store = CheckpointStore(tracker, str(tmp_path / "checkpoints"), keep=2, keep_best=parse_best_rule("accuracy"))
    for step, accuracy in ((10, 0.5), (20, 0.9), (30, 0.7), (40, 0.6)):
        save_and_validate(store, tracker, step, {"accuracy": accuracy, "loss": 1 - accuracy, "rows": 100})

    assert store.committed == [20, 30, 40]
    assert not os.path.exists(checkpoint_artifact_dir(tracker, 10))  # neither newest nor best
    assert os.path.exists(checkpoint_artifact_dir(tracker, 20))
    tags = tracker.client.get_run(tracker.run_id).data.tags
    assert tags[BEST_TAG] == "20 accuracy 0.9" and tags["elastic_step.checkpoints"] == "20,30,40"

    reader = CheckpointStore(tracker, str(tmp_path / "elsewhere"))
    best = reader.best_checkpoint(tracker.run_id)
    assert best.step == 20 and best.state == b"state of 20" * 20
    assert reader.latest(tracker.run_id).step == 40  # the newest is still the newest


def test_a_resumed_run_keeps_comparing_against_its_earlier_best(tmp_path):
    tracker = sqlite_tracker(tmp_path)
    rule = parse_best_rule("val_loss")  # minimised; the val_ prefix as MLflow shows it is accepted
    first = CheckpointStore(tracker, str(tmp_path / "checkpoints"), keep=1, keep_best=rule)
    for step, loss in ((10, 0.4), (20, 0.2), (30, 0.3)):
        save_and_validate(first, tracker, step, {"loss": loss})
    assert first.committed == [20, 30]

    resumed = CheckpointStore(tracker, str(tmp_path / "checkpoints"), keep=1, keep_best=rule)
    assert resumed.latest().step == 30 and resumed.best == (20, 0.2)
    save_and_validate(resumed, tracker, 40, {"loss": 0.25})  # worse than step 20: 30 goes, 20 stays
    assert resumed.committed == [20, 40]
    save_and_validate(resumed, tracker, 50, {"loss": 0.1})  # the new best: 20 may go now
    assert resumed.committed == [50]
    assert tracker.client.get_run(tracker.run_id).data.tags[BEST_TAG] == "50 loss 0.1"
    assert not os.path.exists(checkpoint_artifact_dir(tracker, 20))


def test_a_best_whose_tag_write_failed_once_is_recorded_by_the_uploaders_retry(tmp_path, monkeypatch):
    """MLflow away for a moment while the best checkpoint's tag is written: the uploader retries
    the validation call, and the retry still finds the checkpoint better than the best recorded."""
    tracker = sqlite_tracker(tmp_path)
    store = CheckpointStore(tracker, str(tmp_path / "checkpoints"), keep=1, keep_best=parse_best_rule("accuracy"))
    save_and_validate(store, tracker, 10, {"accuracy": 0.5})
    log_batch, calls = tracker.client.log_batch, []

    def away_once(*args, **kwargs):
        calls.append(kwargs)
        if len(calls) == 1:
            raise ConnectionError("MLflow is away")
        return log_batch(*args, **kwargs)

    store.save(Checkpoint(20, 2, b"state of 20" * 20, {"current_epoch": 0, "epochs": {}}))
    assert tracker.uploader.drain(60)
    monkeypatch.setattr(tracker.client, "log_batch", away_once)
    tracker.uploader.submit("validation of 20", lambda: store.validated(20, {"accuracy": 0.9}))
    assert tracker.uploader.drain(60) and len(calls) == 2
    assert tracker.client.get_run(tracker.run_id).data.tags[BEST_TAG] == "20 accuracy 0.9"
    assert store.best == (20, 0.9)


def test_without_keep_best_only_the_newest_stay_and_asking_for_the_best_says_what_to_do(tmp_path):
    from elastic_step.tracking.run import TrackingError

    tracker = sqlite_tracker(tmp_path)
    store = CheckpointStore(tracker, str(tmp_path / "checkpoints"), keep=1)
    for step, accuracy in ((10, 0.9), (20, 0.1)):
        save_and_validate(store, tracker, step, {"accuracy": accuracy})
    assert store.committed == [20]
    with pytest.raises(TrackingError, match="kept no best checkpoint .* without --keep-best"):
        store.best_checkpoint(tracker.run_id)


def test_best_rules_parse_with_sensible_directions_and_refuse_nonsense():
    assert parse_best_rule("accuracy") == BestRule("accuracy", "max")
    assert parse_best_rule("loss") == BestRule("loss", "min")
    assert parse_best_rule("val_mean_error") == BestRule("mean_error", "min")
    assert parse_best_rule("f1:min") == BestRule("f1", "min")
    for bad in ("", ":max", "accuracy:up"):
        with pytest.raises(ValueError, match="--keep-best .*: give a validation metric"):
            parse_best_rule(bad)


def test_a_checkpoint_made_final_only_by_the_last_reports_is_recorded_when_the_job_succeeds():
    """Step reports go in batches: the steps that make an epoch's checkpoint final can reach the
    master together with the last ones, just before the final model, with no tick between. That
    checkpoint is still recorded (and so validated): a run whose only epoch-end checkpoint came
    so late had no best checkpoint at all."""
    from elastic_step.protocol import JobState

    from test_stop import started, train

    state, handed = started()
    for step in range(1, 8):  # a checkpoint at step 5, and no tick between the reports (one batch)
        train(state, step, checkpoint=step == 5)
    train(state, 8)  # the last rows: every epoch is applied
    assert state.dispatcher.finished and handed == []
    assert state.upload_model("w0.1", 8, b"model")
    state.tick()  # over: ticks hand nothing over any more
    state.lock.writes.flush()
    assert state.state == JobState.SUCCEEDED and handed == [5]
    assert [e["step"] for e in state.events.of("checkpoint")] == [5]


# -- a real job --------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_a_job_keeps_its_best_validated_checkpoint_and_a_later_job_starts_from_it(digits, start_job, tmp_path):
    import json

    from mlflow.tracking import MlflowClient

    from conftest import MODEL

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = ["--data", digits, "--workers", "2", "--model-def", MODEL, "--minibatch-size", "16", "--mlflow-uri", uri]
    job = start_job(*common, "--epochs", "4", "--checkpoint-steps", "1000", "--keep-checkpoints", "1",
                    "--keep-best", "val_accuracy", name="best")
    assert job.finish() == 0, job.output()
    run = MlflowClient(uri).get_run(job.result()["run_id"])
    step, metric, value = run.data.tags[BEST_TAG].split()
    history = {m.step: m.value for m in MlflowClient(uri).get_metric_history(run.info.run_id, "val_accuracy")}
    assert metric == "accuracy" and float(value) == max(history.values()) == history[int(step)]
    kept = [int(s) for s in run.data.tags["elastic_step.checkpoints"].split(",")]
    assert int(step) in kept and len(kept) <= 2  # the newest one, and the best where it is another

    # Cold: the first job's own first step (the same model, data and settings, from its initial
    # weights), so the test needs no other job.
    warm = start_job(*common, "--epochs", "1", "--init-from", f"{run.info.run_id}:best", name="warm")
    assert warm.finish() == 0, warm.output()

    def first_loss(j):
        with open(os.path.join(j.job_dir, "metrics.jsonl")) as f:
            return json.loads(f.readline())["loss"]

    assert first_loss(warm) < 0.5 * first_loss(job)


def test_a_bad_keep_best_is_one_line_before_anything_starts(digits, tmp_path):
    from conftest import MODEL, cli

    done = cli("train", "--data", digits, "--model-def", MODEL, "--job-dir", str(tmp_path / "job"), "--keep-best", "accuracy:up",
               "--no-progress")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == ("elastic-step train: error: --keep-best 'accuracy:up': give a validation "
                                                   "metric, optionally with :min or :max (e.g. accuracy:max)")
    assert not (tmp_path / "job").exists()
