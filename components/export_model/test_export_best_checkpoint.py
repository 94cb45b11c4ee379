"""`export --checkpoint best`: the best validated checkpoint a run kept (`train --keep-best`) is
exported instead of the final model, its weights read from the checkpoint's state file with
`weights_only` (nothing unpickled); each of a run's two exports is its own version, and a retried
one finds the version it registered."""

from __future__ import annotations

import mlflow
import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from elastic_step.cli import main
from elastic_step.frameworks.model_def import load_model_definition
from elastic_step.frameworks.registry import build_trainer
from elastic_step.frameworks.weights import FINAL_MODEL_ARTIFACTS
from elastic_step.release.export import CHECKPOINT_TAG
from elastic_step.tracking.checkpoints import BEST_TAG, Checkpoint, checkpoint_name, write_local

MODEL_DEF = "elastic_step.model_zoo.digits_torch"


def _run(client, experiment, folder, final, best=None):
    """A finished run: `final`'s weights as its final model; `best`'s state as the best checkpoint
    it kept at step 7 (when given)."""
    run_id = client.create_run(experiment).info.run_id
    client.log_param(run_id, "model_def", MODEL_DEF)
    client.log_metric(run_id, "test_accuracy", 0.42)
    weights = folder / run_id / "weights"
    weights.mkdir(parents=True)
    (weights / "model.bin").write_bytes(final.model_bytes())
    client.log_artifacts(run_id, str(weights), FINAL_MODEL_ARTIFACTS)
    if best is not None:
        path = write_local(str(folder / run_id / "checkpoints"), Checkpoint(step=7, epoch=1, state=best.state_bytes(), ledger={}))
        client.log_artifacts(run_id, path, f"checkpoints/{checkpoint_name(7)}")
        client.set_tag(run_id, BEST_TAG, "7 accuracy 0.5")
    client.set_terminated(run_id)
    return run_id


@pytest.fixture()
def runs(tmp_path, monkeypatch):
    from elastic_step.tracking.run import connect

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    connect(uri, str(tmp_path))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = MlflowClient(uri)
    experiment = client.create_experiment("best")
    model_def = load_model_definition(MODEL_DEF)
    final, best = build_trainer(model_def, seed=1), build_trainer(model_def, seed=2)
    return {"uri": uri, "client": client, "final": final, "best": best,
            "kept": _run(client, experiment, tmp_path, final, best), "none": _run(client, experiment, tmp_path, final)}


def export(runs, run_id, data, out, *extra) -> int:
    return main(["export", "--run-id", run_id, "--data", data, "--registered-model", "best-test", "--model-def", MODEL_DEF,
                 "--mlflow-uri", runs["uri"], "--outputs", str(out), *extra])


def predictions(uri: str, model_uri: str, features: np.ndarray) -> np.ndarray:
    mlflow.set_tracking_uri(uri)
    return np.asarray(mlflow.pyfunc.load_model(model_uri).predict(features))


def test_export_best_registers_the_best_checkpoints_weights(runs, dataset, tmp_path):
    features = np.random.default_rng(0).random((4, 64), dtype=np.float32)
    assert export(runs, runs["kept"], dataset.path, tmp_path / "best", "--checkpoint", "best") == 0
    best = (tmp_path / "best" / "model_version").read_text()
    assert export(runs, runs["kept"], dataset.path, tmp_path / "final") == 0
    final = (tmp_path / "final" / "model_version").read_text()
    assert best != final  # two weights of one run: two versions
    client = runs["client"]
    tags = client.get_model_version("best-test", best).tags
    assert tags[CHECKPOINT_TAG] == "best step-000007" and tags[BEST_TAG] == "7 accuracy 0.5"
    assert "test_accuracy" not in tags  # those are the final model's
    assert client.get_model_version("best-test", final).tags[CHECKPOINT_TAG] == "final"
    assert client.get_model_version("best-test", final).tags["test_accuracy"] == "0.42"
    np.testing.assert_allclose(predictions(runs["uri"], f"models:/best-test/{best}", features),
                               runs["best"].predict(features), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(predictions(runs["uri"], f"models:/best-test/{final}", features),
                               runs["final"].predict(features), rtol=1e-5, atol=1e-5)
    assert not np.allclose(runs["best"].predict(features), runs["final"].predict(features))
    # a retried export finds its own version
    assert export(runs, runs["kept"], dataset.path, tmp_path / "again", "--checkpoint", "best") == 0
    assert (tmp_path / "again" / "model_version").read_text() == best
    assert len(client.search_model_versions("name = 'best-test'")) == 2


def test_export_best_of_a_run_that_kept_none_is_one_clear_line(runs, dataset, tmp_path, capsys):
    assert export(runs, runs["none"], dataset.path, tmp_path / "out", "--checkpoint", "best") == 2
    error = capsys.readouterr().err
    assert "kept no best checkpoint" in error and len(error.strip().splitlines()) == 1, error
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as exited:
        export(runs, runs["kept"], dataset.path, tmp_path / "out", "--checkpoint", "newest")
    assert exited.value.code == 2
