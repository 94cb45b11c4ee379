"""TensorFlow 2 / Keras 3 in the elastic engine: the adapter's gradient and state contracts in
process, MLflow logging, and real jobs on digits whose workers are real processes, with
SIGKILLed workers and a SIGKILLed master. TensorFlow's import costs seconds per process, so the
jobs are few and each checks several things."""

import glob
import json
import os
import subprocess
import sys
import time
from collections import defaultdict

import numpy as np
import pytest

from elastic_step.audit import audit_report

from conftest import kill_master, resume_exactly

KERAS_MODEL = "elastic_step.model_zoo.digits_keras"
SLOW_KERAS_MODEL = os.path.join(os.path.dirname(__file__), "model_defs", "slow_digits_keras.py")
# The default heartbeat timeout (10 s): three workers importing TensorFlow at once on two cores
# can hold the GIL long enough to miss a shorter one.
FAST = ["--minibatch-size", "16", "--minibatches-per-task", "2"]


@pytest.fixture(scope="module")
def digits_batch(digits):
    from elastic_step.data.manifest import load_manifest
    from elastic_step.data.reader import ShardReader
    from elastic_step.model_zoo import digits_keras

    return digits_keras.feed(ShardReader(load_manifest(digits)).read("train", 0, 0, 24))


def keras_trainer(seed=0):
    from elastic_step.frameworks.registry import trainer_for

    return trainer_for(KERAS_MODEL, seed=seed)


# -- the adapter, in process ------------------------------------------------------------------
def test_gradient_buffer_is_the_sum_of_per_sample_gradients(digits_batch):
    import tensorflow as tf

    trainer = keras_trainer()
    assert trainer.framework == "tensorflow"
    features, labels = digits_batch
    n = len(labels)
    summed = np.zeros(trainer.num_gradient_values, dtype=np.float32)
    loss_sum = trainer.compute_gradients(features, labels, summed)

    # n x the gradient of the mean loss, computed here without the adapter
    with tf.GradientTape() as tape:
        mean = trainer.model_def.loss(trainer.model(features, training=True), labels)
    mean_grads = np.concatenate([g.numpy().ravel() for g in tape.gradient(mean, trainer.model.trainable_variables)])
    np.testing.assert_allclose(summed, n * mean_grads, rtol=1e-4, atol=1e-5)
    assert loss_sum == pytest.approx(n * float(mean), rel=1e-5)

    # and the sum of one-sample gradients, in uneven pieces (a ragged last batch retraces nothing wrong)
    pieces = np.zeros_like(summed)
    for start, stop in ((0, 1), (1, 8), (8, n)):
        part = np.zeros_like(summed)
        trainer.compute_gradients(features[start:stop], labels[start:stop], part)
        pieces += part
    np.testing.assert_allclose(pieces, summed, rtol=1e-4, atol=1e-5)


def test_state_round_trip_carries_weights_and_optimizer_variables(digits_batch):
    features, labels = digits_batch
    source, target = keras_trainer(seed=0), keras_trainer(seed=1)
    grads = np.zeros(source.num_gradient_values, dtype=np.float32)
    for _ in range(3):
        source.compute_gradients(features, labels, grads)
        source.apply_gradients(grads, len(labels))
    assert not np.allclose(source.predict(features), target.predict(features))

    target.load_state_bytes(source.state_bytes())
    assert target.state_bytes() == source.state_bytes()
    assert int(target.optimizer.iterations.numpy()) == 3
    # Adam's moments travelled too: the next step is the same on both.
    for trainer in (source, target):
        trainer.compute_gradients(features, labels, grads)
        trainer.apply_gradients(grads, len(labels))
    np.testing.assert_array_equal(target.predict(features), source.predict(features))
    assert target.state_bytes() == source.state_bytes()

    fresh = keras_trainer(seed=2)
    fresh.load_model_bytes(source.model_bytes_of_state(source.state_bytes()))
    np.testing.assert_array_equal(fresh.predict(features), source.predict(features))
    assert fresh.loss_value(fresh.predict(features), labels) == pytest.approx(source.loss_value(source.predict(features), labels))

    with pytest.raises(ValueError, match="not a Keras state"):
        fresh.load_state_bytes(b"torch checkpoint bytes")


def test_lr_scaling_sets_the_rate_from_the_model_definitions_and_refuses_a_schedule(digits_batch, monkeypatch):
    import keras

    from elastic_step.errors import ModelDefinitionError
    from elastic_step.frameworks.model_def import load_model_definition
    from elastic_step.frameworks.registry import build_trainer

    trainer = keras_trainer()
    base = float(trainer.optimizer.learning_rate)
    trainer.scale_learning_rate(0.25)
    trainer.scale_learning_rate(0.25)  # never compounding
    assert float(trainer.optimizer.learning_rate) == pytest.approx(base * 0.25)
    other = keras_trainer(seed=1)
    other.load_state_bytes(trainer.state_bytes())
    other.scale_learning_rate(1.0)
    assert float(other.optimizer.learning_rate) == pytest.approx(base)

    model_def = load_model_definition(KERAS_MODEL)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=100, decay_rate=0.9)
    monkeypatch.setattr(model_def.module, "optimizer", lambda model: keras.optimizers.Adam(learning_rate=schedule))
    with pytest.raises(ModelDefinitionError, match="--lr-scaling needs a constant learning rate.*ExponentialDecay"):
        build_trainer(model_def).scale_learning_rate(1.0)


def test_warm_up_changes_no_state_and_the_next_step_is_a_cold_trainers_step(digits_batch):
    features, labels = digits_batch
    warm, cold = keras_trainer(), keras_trainer()
    built = warm.state_bytes()
    warm.warm_up(features[:2], labels[:2])
    assert warm.state_bytes() == built  # weights, Adam slots, iteration count: as built
    for trainer in (warm, cold):
        grads = np.zeros(trainer.num_gradient_values, dtype=np.float32)
        trainer.compute_gradients(features, labels, grads)
        trainer.apply_gradients(grads, len(labels))
    assert int(warm.optimizer.iterations.numpy()) == 1
    assert warm.state_bytes() == cold.state_bytes()


def test_mlflow_models_load_and_predict_the_trained_outputs(digits_batch, tmp_path):
    import mlflow
    from mlflow.models import infer_signature

    features, _ = digits_batch
    trainer = keras_trainer()
    outputs = trainer.predict(features)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    weights = tmp_path / "weights"  # what a finished job logs beside its model: the weights file warm start reads
    weights.mkdir()
    (weights / "model.bin").write_bytes(trainer.model_bytes())
    with mlflow.start_run():
        model = trainer.log_mlflow_model(features[:5], infer_signature(features[:5], outputs[:5]))
        serving = trainer.log_serving_model(features[:5], infer_signature(features[:5], outputs[:5]))
        mlflow.log_artifacts(str(weights), "elastic_step_model")
    assert "tensorflow" in model.flavors and "tensorflow" in serving.flavors
    assert serving.name == "serving-model"
    assert serving.flavors["tensorflow"]["model_type"] == "tf2-module"  # a SavedModel, no Keras needed
    for info in (model, serving):
        predicted = mlflow.pyfunc.load_model(info.model_uri).predict(features)
        np.testing.assert_allclose(np.asarray(predicted), outputs, rtol=1e-5, atol=1e-5)
    # warm start (--init-from models:/...) reads the parameters back from the logged model's run (its weights file, no pickle)
    other = keras_trainer(seed=5)
    other.load_model_bytes(other.model_bytes_of_logged_model(model.model_uri))
    np.testing.assert_array_equal(other.predict(features), outputs)


def test_a_torch_job_never_imports_tensorflow():
    code = ("import sys; from elastic_step.frameworks.registry import trainer_for; "
            "t = trainer_for('elastic_step.model_zoo.digits_torch'); "
            "assert t.framework == 'pytorch'; assert 'tensorflow' not in sys.modules, 'tensorflow imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# -- real jobs ------------------------------------------------------------------------------
def read_weight_digests(weights_dir, events):
    """(worker id, pid) -> [(optimizer iteration, weights digest)] in step order, without the
    warm-up step a worker runs (and rolls back) before it calls in ready."""
    process, ready = {}, {}  # worker id -> pid of its process; pid -> when it called in ready
    for e in events:  # in order, so that a resumed job's w0.1 is not the first job's
        if e["event"] == "joined":
            process[e["worker"]] = e["pid"]
        elif e["event"] == "ready":
            ready[process[e["worker"]]] = e["time"]
    records = {}
    for path in glob.glob(os.path.join(weights_dir, "*.txt")):
        with open(path) as f:
            worker_id, pid = os.path.basename(path)[:-4].rsplit("-", 1)
            lines = [line.split() for line in f if line.strip()]
        records[worker_id, int(pid)] = [(int(i), d) for i, d, t in lines if float(t) > ready.get(int(pid), float("inf"))]
    return records


def assert_ranks_agree(records):
    by_iteration = defaultdict(set)
    for steps in records.values():
        for iteration, digest in steps:
            by_iteration[iteration].add(digest)
    split = {i: d for i, d in by_iteration.items() if len(d) > 1}
    assert not split, f"ranks held different weights at optimizer iterations {sorted(split)[:10]}"
    return by_iteration


@pytest.mark.e2e
def test_keras_sigkill_one_of_three_workers_mid_epoch(digits, start_job, tmp_path, monkeypatch):
    weights_dir = tmp_path / "weights"
    weights_dir.mkdir()
    monkeypatch.setenv("ELASTIC_STEP_TEST_WEIGHTS_DIR", str(weights_dir))  # inherited by the master's workers
    # Long enough that the relaunched worker, importing TensorFlow while the survivors train on,
    # is ready (seconds; tens of seconds on a busy machine) before the data runs out.
    epochs = 16
    job = start_job("--data", digits, "--workers", "2:3", "--epochs", str(epochs), "--model-def", SLOW_KERAS_MODEL, *FAST)
    status = job.wait_for(lambda s: s["world_size"] == 3 and 0.05 < s["rows_done"] / s["rows_total"] < 0.3, timeout=180)
    victim = job.kill_worker(status, rank=1)
    assert job.finish() == 0, job.output()

    report = audit_report(job.audit, digits, epochs)
    assert report["exact"], report
    result = job.result()
    assert report["rows_applied"] == result["rows_audited"]
    assert result["test_metrics"]["accuracy"] >= 0.90, result
    events = job.events()
    died = [e for e in events if e["event"] == "died"]
    assert died and died[0]["worker"] == victim["id"] and "SIGKILL" in died[0]["reason"]
    assert any(e["event"] == "recovered" for e in events)
    relaunched = [e for e in events if e["event"] == "relaunched"]
    assert relaunched
    # The survivors kept training while the relaunched worker imported TensorFlow: the round
    # that takes it in is proposed only after it called in ready, and forms at once.
    joiner = next(e["worker"] for e in events if e["event"] == "launched" and e["attempt"] == 2)
    ready_at = next(e["time"] for e in events if e["event"] == "ready" and e["worker"] == joiner)
    joined_round = next(e for e in events if e["event"] == "round_proposed" and joiner in e["members"])
    assert joined_round["time"] >= ready_at
    formed = next(e for e in events if e["event"] == "regrouped" and e["round"] == joined_round["round"])
    assert formed["time"] - joined_round["time"] < 5, (joined_round, formed)

    # Every step, every rank that computed a gradient held the same weights -- the survivors
    # across the regroup and the relaunched worker, which started from the broadcast state.
    records = read_weight_digests(str(weights_dir), events)
    by_iteration = assert_ranks_agree(records)
    joiners = [key for key in records if key[0] not in {w["id"] for w in status["workers"]}]
    assert joiners, records.keys()
    joined = records[joiners[0]]
    assert joined[0][0] > 0  # it began where the survivors were, not from its own initial weights
    assert any(len(by_iteration[i]) == 1 and sum(i in dict(r) for r in records.values()) >= 2 for i, _ in joined)
    assert max(by_iteration) == result["steps"] - 1

    with open(os.path.join(result["model_dir"], "model.json")) as f:
        assert json.load(f)["framework"] == "tensorflow"
    assert result["model_uri"].startswith("models:/")


@pytest.mark.e2e
def test_keras_master_sigkill_then_resume_restores_weights_optimizer_and_ledger(digits, start_job, tmp_path, monkeypatch):
    weights_dir = tmp_path / "weights"
    weights_dir.mkdir()
    monkeypatch.setenv("ELASTIC_STEP_TEST_WEIGHTS_DIR", str(weights_dir))
    args = ["--data", digits, "--workers", "2", "--epochs", "3", "--model-def", SLOW_KERAS_MODEL, *FAST,
            "--checkpoint-steps", "15", "--master-timeout", "5"]
    first = start_job(*args, name="job")
    first.wait_for(lambda s: s["epoch"] >= 1 and s["rows_done"] > 0.4 * s["rows_total"], timeout=180)
    kill_master(first)
    first_events = first.events()  # the resumed job starts a new events.jsonl in the same job dir
    before = set(read_weight_digests(str(weights_dir), first_events))

    second, resumed_from = resume_exactly(start_job, args, digits, epochs=3)

    # The resumed workers' optimizer starts at the checkpoint's step (its variables were in the
    # checkpoint), and the weights they resumed with are the ones the first job had there.
    records = read_weight_digests(str(weights_dir), first_events + second.events())
    resumed = {w: steps for w, steps in records.items() if w not in before}
    assert resumed and all(steps[0][0] == resumed_from for steps in resumed.values()), resumed
    first_job = {i: d for w in before for i, d in records[w]}
    assert first_job[resumed_from] == next(iter(resumed.values()))[0][1]
    # Ranks agree within each job. Across the two they need not after the checkpoint: steps the
    # first job applied after it are void, and the resumed job redoes those rows in its own order.
    assert_ranks_agree({w: steps for w, steps in records.items() if w in before})
    assert_ranks_agree(resumed)
