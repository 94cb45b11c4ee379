import json
import os

from mlflow.tracking import MlflowClient


def test_train_elastic_outputs_the_model_with_its_mlflow_run(trained, mlflow_uri):
    assert {"model.bin", "model.json"} <= set(os.listdir(trained.path))
    assert json.load(open(os.path.join(trained.path, "model.json")))["framework"] == "pytorch"
    meta = trained.metadata
    assert meta["framework"] == "pytorch" and meta["model_uri"].startswith("models:/")
    run = MlflowClient(mlflow_uri).get_run(meta["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["workers"] == "2" and run.data.params["epochs"] == "4"
    # the test metrics the step reports are the ones the run recorded
    assert abs(trained.test_metrics["accuracy"] - run.data.metrics["test_accuracy"]) < 1e-9
    assert trained.test_metrics["accuracy"] >= 0.85


def test_train_elastic_reports_its_history_as_metrics_and_a_page(trained):
    # no worker died in this job: the history says so (one round formed), beside the test metrics
    assert {k: trained.test_metrics[k] for k in ("relaunches", "regroups", "recoveries", "recovery_s_max")} == {
        "relaunches": 0.0, "regroups": 1.0, "recoveries": 0.0, "recovery_s_max": 0.0}
    page = open(trained.report_path).read()
    assert page.lstrip().lower().startswith("<!doctype html") and "<svg" in page
    assert all(f"<h2>{title}</h2>" in page for title in ("Loss", "Samples/s", "World size")) and "succeeded" in page
