"""Warm start, the gate and export never unpickle a model from MLflow: a writer to MLflow who
plants a malicious pickle as a run's logged model (or as its weights file) gets no code run.
They read the run's own weights file (`elastic_step_model/model.bin`) with
`torch.load(weights_only=True)` and build the network from the model definition they are given,
not from the run's `model_def` parameter."""

from __future__ import annotations

import contextlib
import io
import os
import pickle

import mlflow
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from elastic_step.frameworks.model_def import load_model_definition
from elastic_step.frameworks.registry import build_trainer
from elastic_step.frameworks.weights import FINAL_MODEL_ARTIFACTS, WeightsError
from elastic_step.tracking.run import connect

MODEL_DEF = "elastic_step.model_zoo.digits_torch"


class Payload:
    """Unpickling this makes a folder: proof that code ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def malicious_pickle(marker: str) -> bytes:
    return pickle.dumps(Payload(marker))


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A finished training run as an attacker with write access to MLflow left it: real weights
    in its weights file, a pickle that runs code as its logged pytorch model (`runs:/RUN/model`),
    a `model_def` parameter naming code that must not be imported, and a registered @champion
    made from that planted model."""
    tmp_path = tmp_path_factory.mktemp("planted")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    connect(uri, str(tmp_path))
    previous, previous_env = mlflow.get_tracking_uri(), os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    os.environ["MLFLOW_TRACKING_URI"] = uri
    marker = str(tmp_path / "pwned")
    trainer = build_trainer(load_model_definition(MODEL_DEF), seed=1)
    client = MlflowClient(uri)
    experiment = client.create_experiment("planted")
    run_id = client.create_run(experiment).info.run_id
    client.log_param(run_id, "model_def", "attacker_module_that_must_not_be_imported")
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "model.bin").write_bytes(trainer.model_bytes())
    client.log_artifacts(run_id, str(weights), FINAL_MODEL_ARTIFACTS)
    logged = tmp_path / "logged"
    mlflow.pytorch.save_model(trainer.net, str(logged), serialization_format="pickle", pip_requirements=["torch"])
    (logged / "data" / "model.pth").write_bytes(malicious_pickle(marker))
    client.log_artifacts(run_id, str(logged), "model")
    client.set_terminated(run_id)
    client.create_registered_model("planted")
    version = client.create_model_version("planted", f"{client.get_run(run_id).info.artifact_uri}/model", run_id=run_id)
    client.set_registered_model_alias("planted", "champion", version.version)
    yield {"uri": uri, "run_id": run_id, "marker": marker, "trainer": trainer, "client": client,
           "experiment": experiment, "folder": tmp_path}
    mlflow.set_tracking_uri(previous)
    if previous_env is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = previous_env


def test_the_planted_pickle_does_run_code_when_mlflow_loads_it(planted):
    # The control: MLflow's own pytorch loader unpickles it, and the payload runs. Everything
    # below must never get here.
    with contextlib.suppress(Exception):  # what it returns (os.mkdir's None) is beside the point
        mlflow.pytorch.load_model(f"runs:/{planted['run_id']}/model")
    assert os.path.isdir(planted["marker"])
    os.rmdir(planted["marker"])


@pytest.mark.parametrize("source", ["runs:/{run_id}/model", "models:/planted@champion", "models:/planted/1"])
def test_warm_start_reads_the_runs_weights_file_and_runs_no_pickle(planted, source):
    fresh = build_trainer(load_model_definition(MODEL_DEF), seed=2)
    data = fresh.model_bytes_of_logged_model(source.format(run_id=planted["run_id"]))
    assert not os.path.exists(planted["marker"])
    expected = planted["trainer"].net.state_dict()
    loaded = torch.load(io.BytesIO(data), weights_only=True)
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_a_pickle_planted_as_the_weights_file_is_refused_not_run(planted):
    client = planted["client"]
    run_id = client.create_run(planted["experiment"]).info.run_id
    evil = planted["folder"] / "evil"
    evil.mkdir()
    (evil / "model.bin").write_bytes(malicious_pickle(planted["marker"]))
    client.log_artifacts(run_id, str(evil), FINAL_MODEL_ARTIFACTS)
    fresh = build_trainer(load_model_definition(MODEL_DEF))
    with pytest.raises(WeightsError, match="do not fit"):
        fresh.model_bytes_of_logged_model(f"runs:/{run_id}/model")
    assert not os.path.exists(planted["marker"])


def test_the_gate_judges_candidate_and_champion_from_weights_with_the_given_model_definition(planted, dataset):
    from elastic_step.release.candidate import predict_split
    from elastic_step.release.gate import evaluate_candidate

    data = dataset
    result = evaluate_candidate(run_id=planted["run_id"], model_uri=f"runs:/{planted['run_id']}/model", data=data.path,
                                registered_model="planted", floors=["accuracy=0.0"],
                                mlflow_uri=planted["uri"], model_def=MODEL_DEF)
    assert not os.path.exists(planted["marker"])
    assert result.champion_version == "1" and result.model_type == "classifier"
    # Candidate and champion are the same weights here: the same outputs, as the network computes them.
    (candidate, champion), labels = predict_split([f"runs:/{planted['run_id']}/model", "models:/planted@champion"], data.path,
                                                  load_model_definition(MODEL_DEF), tracking_uri=planted["uri"])
    np.testing.assert_array_equal(candidate, champion)
    assert result.candidate_metrics["accuracy_score"] == pytest.approx(float((candidate.argmax(axis=1) == labels).mean()))
    assert not os.path.exists(planted["marker"])
