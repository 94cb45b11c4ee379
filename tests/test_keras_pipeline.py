"""The full training pipeline once with the Keras model definition, through KFP's local runner
(real tasks, real worker processes, a real SQLite MLflow store): the Keras candidate is
trained, judged by the same gate, exported as a TensorFlow SavedModel and promoted. TensorFlow's
import costs seconds in every task process, so the run is short: two workers, two epochs."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from elastic_step.audit import audit_report

NAME = "digits-keras-pipeline-test"
EPOCHS = 2


@pytest.mark.e2e
def test_training_pipeline_with_the_keras_model_blesses_exports_a_savedmodel_and_promotes(tmp_path):
    import mlflow
    from kfp import local
    from mlflow.tracking import MlflowClient

    from elastic_step.pipelines.training_pipeline import training_pipeline
    from elastic_step.release.candidate import predict_split
    from elastic_step.tracking.run import connect
    from elastic_step.frameworks.model_def import load_model_definition

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    connect(uri, str(tmp_path))
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "kfp"))
    job_dir = str(tmp_path / "train")
    training_pipeline(model_def="elastic_step.model_zoo.digits_keras", registered_model=NAME, mlflow_uri=uri,
                      job_dir=job_dir, workers="2", epochs=EPOCHS, minibatch_size=16, rows_per_shard=256,
                      floors={"accuracy": 0.9}, min_gains={"accuracy": 0.0})

    result = json.load(open(os.path.join(job_dir, "result.json")))
    model_info = json.load(open(os.path.join(job_dir, "model", "model.json")))
    assert model_info["framework"] == "tensorflow"
    report = audit_report(os.path.join(job_dir, "audit.jsonl"), model_info["data"], epochs=EPOCHS)
    assert report["exact"], report
    assert report["rows_applied"] == result["rows_audited"]

    # Blessed on the floors (there is no champion yet), and the reason is on the training run.
    client = MlflowClient(uri)
    tags = client.get_run(result["run_id"]).data.tags
    assert tags["elastic_step.gate.blessed"] == "true"
    assert tags["elastic_step.gate.reason"].startswith("blessed (first model: floors only): accuracy_score")
    assert "meets the floor 0.9" in tags["elastic_step.gate.reason"]

    # Promoted: @champion is the version exported from this run, as a SavedModel.
    champion = client.get_model_version_by_alias(NAME, "champion")
    assert champion.tags["elastic_step.source_run_id"] == result["run_id"]
    assert champion.tags["framework"] == "tensorflow"
    assert champion.tags["pipeline_run_id"]
    flavor = mlflow.models.get_model_info(f"models:/{NAME}/{champion.version}").flavors["tensorflow"]
    assert flavor["model_type"] == "tf2-module"  # a SavedModel with serving_default, not a .keras file

    # It loads with pyfunc and predicts what the candidate the gate judged predicts.
    (served, candidate), labels = predict_split([f"models:/{NAME}@champion", result["model_uri"]], model_info["data"],
                                                load_model_definition("elastic_step.model_zoo.digits_keras"))
    assert served.shape == (len(labels), 10)
    np.testing.assert_allclose(served, candidate, rtol=1e-5, atol=1e-5)
    assert (served.argmax(axis=1) == labels).mean() >= 0.9
