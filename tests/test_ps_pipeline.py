"""The training pipeline with a model whose embedding table lives on parameter-server shards
(`mode=ps`), compiled and run through KFP's local runner: real tasks (each its own process), the
Keras DeepFM trained by two workers against two shard processes in the train task, judged by the
gate, exported as a SavedModel and promoted, with a real SQLite MLflow store.

What it checks, besides the run succeeding:
- the shards: each held part of the table, the run recorded what each held (ps.shardI.*), and
  each embedding row's update counter equals the count computed from the data with the PyTorch
  DeepFM's feed (both front ends give the same ids; every minibatch updated each of its distinct
  ids exactly once);
- the models a user gets hold the trained table, not the initial rows: the model the run logged
  (a .keras file) and the exported SavedModel, each loaded in this process (where no model was
  given this run's table: the tasks ran in processes of their own), predict what the trained
  dense weights with the shards' final table predict, and not what they predict with a fresh
  table's rows.

One epoch on 2,000 rows: every task process imports TensorFlow, so the run is kept short."""

from __future__ import annotations

import json
import os
from collections import Counter
from functools import partial

import numpy as np
import pytest

NAME = "deepfm-ps-pipeline-test"
DEEPFM_PS_KERAS = "elastic_step.model_zoo.deepfm_ps_keras"
TABLE = "deepfm_ids"
MINIBATCH = 128
SHARDS = 2


@pytest.mark.e2e
def test_training_pipeline_in_ps_mode_trains_on_shards_and_its_models_hold_the_trained_table(tmp_path):
    import mlflow
    from kfp import local
    from mlflow.tracking import MlflowClient

    from elastic_step.frameworks.model_def import load_model_definition
    from elastic_step.master.ps_rows import snapshot_table
    from elastic_step.master.ps_tables import table_specs
    from elastic_step.pipelines.training_pipeline import training_pipeline
    from elastic_step.ps import snapshot
    from elastic_step.ps.expected_updates import expected_updates
    from elastic_step.ps.table import initial_weights
    from elastic_step.release.candidate import split_head
    from elastic_step.tracking.run import connect

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    connect(uri, str(tmp_path))
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "kfp"))
    job_dir = str(tmp_path / "train")
    # The gate judges a click model on AUC and log loss (one epoch of 2,000 rows barely learns: AUC
    # about 0.5); a log-loss floor this run passes, so it follows the blessed path to export and promote.
    training_pipeline(source="synthetic:criteo?rows=2000&seed=3", categorical="auto", rows_per_shard=500,
                      model_def=DEEPFM_PS_KERAS, mode="ps", ps_shards=SHARDS, workers="2", epochs=1,
                      minibatch_size=MINIBATCH, checkpoint_steps=0, registered_model=NAME, mlflow_uri=uri, job_dir=job_dir,
                      floors={"log_loss": 1.0}, min_gains={"auc": 0.0})

    result = json.load(open(os.path.join(job_dir, "result.json")))
    model_info = json.load(open(os.path.join(job_dir, "model", "model.json")))
    data = model_info["data"]
    client = MlflowClient(uri)
    run = client.get_run(result["run_id"])
    assert run.info.status == "FINISHED" and model_info["framework"] == "tensorflow"
    assert (run.data.params["mode"], run.data.params["ps_shards"]) == ("ps", str(SHARDS))

    # each shard held part of the table, and the run recorded what each held
    counters = Counter()
    shard_dirs = [os.path.join(job_dir, "ps", f"shard-{i}") for i in range(SHARDS)]
    for i, directory in enumerate(shard_dirs):
        held = snapshot.load(os.path.join(directory, "snapshot.bin"), [TABLE])[0][TABLE]
        assert len(held["ids"]) > 0 and run.data.metrics[f"ps.shard{i}.rows"] == len(held["ids"])
        assert run.data.metrics[f"ps.shard{i}.pushes"] > 0
        counters.update({i: u for i, u in zip(held["ids"].tolist(), held["updates"].tolist()) if u})
    # each minibatch updated each of its distinct ids once, whoever trained it; the PyTorch DeepFM's ids
    expected = expected_updates(data, "elastic_step.model_zoo.deepfm_ps_torch", MINIBATCH)
    wrong = {i: (counters[i], expected[i]) for i in set(counters) | set(expected) if counters[i] != expected[i]}
    assert not wrong, f"{len(wrong)} rows updated other than once per minibatch, e.g. {list(wrong.items())[:5]}"

    # blessed on AUC and log loss, exported from this run as a SavedModel, promoted
    reason = run.data.tags.get("elastic_step.gate.reason", "")
    assert run.data.tags["elastic_step.gate.blessed"] == "true", reason
    assert "log_loss" in reason, reason
    (evaluation,) = client.search_runs([run.info.experiment_id], "tags.`elastic_step.gate` = 'evaluation'")
    assert {"auc", "log_loss", "accuracy_score"} <= set(evaluation.data.metrics), evaluation.data.metrics
    assert 0 < evaluation.data.metrics["log_loss"] <= 1.0 and 0 <= evaluation.data.metrics["auc"] <= 1
    champion = client.get_model_version_by_alias(NAME, "champion")
    assert champion.tags["elastic_step.source_run_id"] == result["run_id"]
    assert mlflow.models.get_model_info(f"models:/{NAME}/{champion.version}").flavors["tensorflow"]["model_type"] == "tf2-module"

    # The reference: the trained dense weights with the shards' final table as the rows' source.
    model_def = load_model_definition(DEEPFM_PS_KERAS)
    features = split_head(data, model_def, rows=64)
    spec, = table_specs(DEEPFM_PS_KERAS)
    ids, rows = snapshot_table(spec, shard_dirs)
    order = np.argsort(ids)
    ids, rows = ids[order], rows[order]

    def shards_rows(wanted: np.ndarray) -> np.ndarray:  # zeros for an id no shard holds (unseen in training)
        at = np.minimum(np.searchsorted(ids, wanted), len(ids) - 1)
        return rows[at] * (ids[at] == wanted)[:, None]

    reference = predict_with(model_def, os.path.join(job_dir, "model", "model.bin"), features, shards_rows)
    untrained_table = predict_with(model_def, os.path.join(job_dir, "model", "model.bin"), features,
                                   partial(initial_weights, spec))
    assert not np.allclose(reference, untrained_table, atol=1e-4)  # the table matters to these rows

    logged = mlflow.tensorflow.load_model(result["model_uri"])  # the .keras file the run logged
    np.testing.assert_allclose(logged.predict(features, verbose=0).reshape(-1), reference.reshape(-1), rtol=1e-5, atol=1e-6)
    served = mlflow.pyfunc.load_model(f"models:/{NAME}@champion")  # the SavedModel export made
    np.testing.assert_allclose(np.asarray(served.predict(features)).reshape(-1), reference.reshape(-1), rtol=1e-5, atol=1e-6)


def predict_with(model_def, weights_file: str, features: np.ndarray, source) -> np.ndarray:
    """The model definition's network with the run's dense weights, its table's rows from `source`."""
    from elastic_step.frameworks.registry import build_trainer
    from elastic_step.ps.embedding import embeddings

    trainer = build_trainer(model_def)
    with open(weights_file, "rb") as f:
        trainer.load_model_bytes(f.read())
    for embedding in embeddings(trainer.model):
        embedding.ps_table.source = source
    return trainer.predict(features)
