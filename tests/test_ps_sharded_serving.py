"""A `--mode ps` model whose tables exceed `train --ps-table-limit-mb` (set to 0 here, so that a
small run takes the path): the master does not hold its tables whole but logs the shards' final
snapshots beside the weights file, with an MLflow pyfunc model that serves from them.

End to end, with a real job of each front end's DeepFM (PyTorch's and Keras', one worker, two
shards, one epoch) and its SQLite MLflow store: the pyfunc loaded back with
mlflow.pyfunc.load_model (here and in a fresh process), the gate's network
(release/candidate.load_weights) and the master's test evaluation all give what the trained
dense weights with the whole table (the shards' snapshots merged, as the master freezes a table
that fits) give; `export` of the run is refused in one line (exit 2) naming the pyfunc to serve.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial

import numpy as np
import pytest
from conftest import Job, cli, synthetic_clicks

DEEPFM_PS = {"pytorch": "elastic_step.model_zoo.deepfm_ps_torch", "keras": "elastic_step.model_zoo.deepfm_ps_keras"}
SHARDS = 2


@pytest.fixture(scope="module")
def clicks(tmp_path_factory) -> str:
    return synthetic_clicks(tmp_path_factory.mktemp("ctr") / "data", rows=2000, seed=3, rows_per_shard=500)


@pytest.fixture(scope="module", params=list(DEEPFM_PS))
def sharded_run(request, clicks, tmp_path_factory):
    """(model definition, finished job) of one front end's DeepFM, its tables over the limit: one
    job per front end, shared by this module's tests (each job imports its framework, for seconds)."""
    from elastic_step.frameworks.model_def import load_model_definition

    source = DEEPFM_PS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    # The model definition as a .py file, as users often give it: the pyfunc must carry it.
    model_def_file = folder / "deepfm_as_a_file.py"
    model_def_file.write_text(open(load_model_definition(source).module.__file__).read())
    job = Job(str(folder / "job"), ["--model-def", str(model_def_file), "--data", clicks, "--mode", "ps",
                                    "--ps-shards", str(SHARDS), "--workers", "1", "--epochs", "1", "--minibatch-size", "128",
                                    "--checkpoint-steps", "0", "--ps-table-limit-mb", "0"])
    try:
        assert job.finish(timeout=600) == 0, job.output()
    finally:
        job.log.close()
    # A serving process has another file system: the pyfunc must not need the file it was trained from.
    model_def_file.unlink()
    return source, job


def whole_table_trainer(job_dir: str, model_def, source=None):
    """The run's dense weights with the whole table the shards' snapshots hold (or `source`'s rows)."""
    from elastic_step.frameworks.registry import build_trainer
    from elastic_step.master.ps_rows import snapshot_table
    from elastic_step.master.ps_tables import table_specs
    from elastic_step.ps.embedding import embeddings, hold_tables, trainer_network

    trainer = build_trainer(model_def)
    with open(os.path.join(job_dir, "model", "model.bin"), "rb") as f:
        trainer.load_model_bytes(f.read())
    if source is not None:
        for embedding in embeddings(trainer_network(trainer)):
            embedding.ps_table.source = source
        return trainer
    shard_dirs = [os.path.join(job_dir, "ps", f"shard-{i}") for i in range(SHARDS)]
    specs = table_specs(model_def.source)
    hold_tables(trainer_network(trainer), {spec.name: snapshot_table(spec, shard_dirs) for spec in specs})
    return trainer


SERVE_IN_A_FRESH_PROCESS = """
import os, sys
import mlflow, numpy as np
mlflow.set_tracking_uri(sys.argv[1])
model = mlflow.pyfunc.load_model(sys.argv[2])
np.save(os.path.join(sys.argv[3], "served.npy"), np.asarray(model.predict(np.load(os.path.join(sys.argv[3], "features.npy")))))
"""


def test_tables_over_the_limit_are_served_from_the_shards_snapshots_by_a_pyfunc_model(clicks, sharded_run):
    import mlflow

    from elastic_step.data.manifest import load_manifest
    from elastic_step.evaluation import evaluate
    from elastic_step.frameworks.model_def import load_model_definition
    from elastic_step.master.ps_tables import table_specs
    from elastic_step.ps.table import initial_weights
    from elastic_step.release.candidate import load_weights, split_head

    source, job = sharded_run
    model_dir = os.path.join(job.job_dir, "model")
    assert os.path.exists(os.path.join(model_dir, "ps_shards", "manifest.json"))
    assert not os.path.exists(os.path.join(model_dir, "ps_tables.npz"))  # the master never held the table whole
    result = job.result()
    uri = f"sqlite:///{os.path.join(job.job_dir, 'mlflow.db')}"
    mlflow.set_tracking_uri(uri)

    model_def = load_model_definition(source)
    features = split_head(clicks, model_def, rows=64)
    whole = whole_table_trainer(job.job_dir, model_def)
    reference = np.asarray(whole.predict(features))
    spec, = table_specs(source)
    untrained = whole_table_trainer(job.job_dir, model_def, partial(initial_weights, spec)).predict(features)
    assert not np.allclose(reference, untrained, atol=1e-4)  # the table matters to these rows

    served = mlflow.pyfunc.load_model(result["model_uri"])
    assert served.metadata.flavors.keys() == {"python_function"}
    np.testing.assert_allclose(np.asarray(served.predict(features)), reference, rtol=1e-5, atol=1e-6)
    # A serving process has no dataset loaded and none of this one's imports: the pyfunc brings
    # the specs the network is sized by, and the model definition's file.
    np.save(os.path.join(job.job_dir, "features.npy"), features)
    served_elsewhere = subprocess.run([sys.executable, "-c", SERVE_IN_A_FRESH_PROCESS, uri, result["model_uri"], job.job_dir],
                                      capture_output=True, text=True, timeout=300)
    assert served_elsewhere.returncode == 0, served_elsewhere.stderr[-3000:]
    np.testing.assert_allclose(np.load(os.path.join(job.job_dir, "served.npy")), reference, rtol=1e-5, atol=1e-6)
    gate_model = load_weights(result["model_uri"], model_def, uri)  # what the gate judges
    np.testing.assert_allclose(np.asarray(gate_model.predict(features)), reference, rtol=1e-5, atol=1e-6)
    # the master's test evaluation looked the rows up in the shards' snapshots too
    expected = evaluate(whole, model_def, load_manifest(clicks), "test")
    assert result["test_metrics"]["auc"] == pytest.approx(expected["auc"], abs=1e-6), (result["test_metrics"], expected)
    assert result["test_metrics"]["loss"] == pytest.approx(expected["loss"], rel=1e-5)


def test_export_of_such_a_run_is_refused_and_its_snapshots_are_logged_once(clicks, sharded_run):
    from mlflow.tracking import MlflowClient

    source, job = sharded_run
    result = job.result()
    uri = f"sqlite:///{os.path.join(job.job_dir, 'mlflow.db')}"
    export = ["export", "--run-id", result["run_id"], "--model-uri", result["model_uri"], "--data", clicks,
              "--registered-model", "ctr-sharded", "--mlflow-uri", uri, "--model-def", source]
    refused = cli(*export)
    assert refused.returncode == 2, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "--ps-table-limit-mb" in refused.stderr and f"serve its MLflow pyfunc model {result['model_uri']}" in refused.stderr
    best = cli(*export, "--checkpoint", "best")  # a --mode ps run logs only its final tables
    assert best.returncode == 2 and len(best.stderr.strip().splitlines()) == 1, best.stderr
    assert "export its final model (--checkpoint final)" in best.stderr, best.stderr
    with open(os.path.join(job.job_dir, "logs", "master.log")) as f:
        assert "exceed --ps-table-limit-mb" in f.read()
    with open(os.path.join(job.job_dir, "model", "ps_shards", "manifest.json")) as f:
        assert json.load(f)["files"] == ["shard-0.bin", "shard-1.bin"]  # one file per shard, as on disk
    # The snapshots are stored once, in the pyfunc (which the gate read); beside the weights only
    # their manifest.
    logged = [a.path for a in MlflowClient(uri).list_artifacts(result["run_id"], "elastic_step_model/ps_shards")]
    assert logged == ["elastic_step_model/ps_shards/manifest.json"], logged


@pytest.mark.parametrize("limit", ["-1", "nan"])
def test_a_bad_table_limit_is_one_line_and_exit_2(tmp_path, limit):
    done = cli("train", "--model-def", DEEPFM_PS["pytorch"], "--data", str(tmp_path / "nowhere"), "--job-dir", str(tmp_path / "job"),
               "--mode", "ps", "--ps-table-limit-mb", limit)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "--ps-table-limit-mb must be >= 0" in done.stderr and limit in done.stderr, done.stderr
    assert not (tmp_path / "job").exists()
