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
