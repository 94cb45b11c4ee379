"""MLflow as the memory of every run, against a real `mlflow server` on 127.0.0.1 and against a
plain SQLite URI: what is recorded, checkpoints, warm start and MLflow outages (a master SIGKILLed
and resumed: test_resume_edges.py)."""

import json
import os

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from conftest import MODEL, SLOW_MODEL, cli

pytestmark = pytest.mark.e2e

FAST = ["--minibatch-size", "16", "--minibatches-per-task", "2"]


def test_run_records_params_metrics_events_plots_checkpoints_and_a_model_that_loads(digits, trained_run, mlflow_server, tmp_path):
    # trained_run: 2 workers, 2 epochs of MODEL, --experiment recorded --checkpoint-steps 20
    result = trained_run.result()
    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(result["run_id"])
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["workers"] == "2" and params["epochs"] == "2" and params["model_def"] == MODEL
    assert params["data_content_hash"] == json.load(open(os.path.join(digits, "manifest.json")))["content_hash"]
    for metric in ("loss", "samples_per_s", "world_size", "val_loss", "val_accuracy", "test_accuracy"):
        assert metric in run.data.metrics, metric
    history = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
    assert history == sorted(history) and history[-1] == result["steps"]  # summarised, up to the last step
    logged = json.loads(client.download_artifacts(run.info.run_id, "metrics.jsonl", str(tmp_path)) and open(
        os.path.join(str(tmp_path), "metrics.jsonl")).readline())
    assert logged["step"] == 1  # every step is in the artifact
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"events.jsonl", "metrics.jsonl", "plots", "checkpoints"} <= artifacts
    committed = run.data.tags["elastic_step.checkpoints"].split(",")
    assert len(committed) == 3  # --keep-checkpoints 3: older ones deleted
    assert {a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")} == {f"checkpoints/step-{int(s):06d}" for s in committed}

    import mlflow
    import mlflow.pytorch
    import torch

    mlflow.set_tracking_uri(mlflow_server.uri)
    model = mlflow.pytorch.load_model(result["model_uri"])
    x = torch.rand(4, 64)
    assert model(x).shape == (4, 10)


def last_audited_step(path):
    steps = [json.loads(line).get("step", 0) for line in open(path) if line.strip()]
    return max(steps) if steps else 0


def first_loss(job_dir):
    with open(os.path.join(job_dir, "metrics.jsonl")) as f:
        return json.loads(f.readline())["loss"]


def test_warm_start_from_the_champion_lowers_the_first_step_loss(digits, start_job, mlflow_server, trained_run):
    common = ["--data", digits, "--workers", "2", "--model-def", MODEL, *FAST, "--mlflow-uri", mlflow_server.uri,
              "--experiment", "warm", "--seed", "3"]
    import mlflow

    mlflow.set_tracking_uri(mlflow_server.uri)
    version = mlflow.register_model(trained_run.result()["model_uri"], "digits-warm")  # trained 2 epochs
    MlflowClient(mlflow_server.uri).set_registered_model_alias("digits-warm", "champion", version.version)

    # Cold: trained_run's own first step, from the model's initial weights on the same data.
    warm = start_job(*common, "--epochs", "1", "--init-from", "models:/digits-warm@champion", name="warm")
    assert warm.finish() == 0, warm.output()
    assert first_loss(warm.job_dir) < 0.5 * first_loss(trained_run.job_dir)


def test_unreachable_mlflow_at_start_is_a_clear_error_before_any_worker(tmp_path, digits):
    done = cli("train", "--model-def", MODEL, "--data", digits, "--job-dir", str(tmp_path / "job"), "--no-progress",
               "--mlflow-uri", "http://127.0.0.1:9", timeout=120)
    assert done.returncode != 0
    message = done.stderr.strip().splitlines()[-1]
    assert "http://127.0.0.1:9" in message and "not reachable" in message
    assert not (tmp_path / "job" / "logs").exists()


def test_mlflow_outage_mid_run_the_job_finishes_and_no_checkpoint_is_lost(digits, start_job, tmp_path):
    from mlflow_server import MlflowServer

    server = MlflowServer(str(tmp_path))
    server.start()
    try:
        job = start_job("--data", digits, "--workers", "2", "--epochs", "5", "--model-def", SLOW_MODEL, *FAST,
                        "--mlflow-uri", server.uri, "--checkpoint-steps", "10", "--keep-checkpoints", "100")
        job.wait_for(lambda s: s["rows_done"] > 0.1 * s["rows_total"])
        server.stop()
        job.wait_for(lambda s: s["rows_done"] > 0.6 * s["rows_total"])
        server.start()
        assert job.finish() == 0, job.output()
        client = MlflowClient(server.uri)
        run = client.get_run(job.result()["run_id"])
        assert run.info.status == "FINISHED"
        saved = [e["step"] for e in job.events() if e["event"] == "checkpoint"]
        committed = [int(s) for s in run.data.tags["elastic_step.checkpoints"].split(",")]
        assert saved and committed == saved
        uploaded = {a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")}
        assert uploaded == {f"checkpoints/step-{s:06d}" for s in saved}
    finally:
        server.stop()
