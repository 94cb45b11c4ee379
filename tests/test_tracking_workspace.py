"""MLFLOW_WORKSPACE as KFP's MLflow integration hands it to a task (kubeflow/pipelines, proposal
12862: the driver sets it beside MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_ID and MLFLOW_RUN_ID).

The project does nothing of its own with it, by choice: MLflow's client (3.17) reads the variable
itself and sends it as the `X-MLFLOW-WORKSPACE` header on every REST call, so every experiment,
run and registered model a step makes or looks up is in that workspace. What the project must not
do is lose it (a step's MLflow calls all run in the step's own process, with its environment).
This test holds that against a real server with workspaces on (`mlflow server
--enable-workspaces`): the train, export and promote components, each with KFP's environment for
workspace `team-a`, keep their runs and models there, and the default workspace sees none of them.
"""

from __future__ import annotations

import pytest
from kfp.dsl import HTML, Metrics, Model
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from mlflow_server import MlflowServer
from test_mlflow_handover import MODEL_DEF, dataset, step_env  # noqa: F401  (fixtures)

WORKSPACE = "team-a"
REGISTERED = "workspace-model"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    mlflow = MlflowServer(str(tmp_path_factory.mktemp("mlflow-workspaces")), workspaces=True)
    mlflow.start(timeout=240)
    yield mlflow
    mlflow.stop()


def test_a_kfp_task_in_a_workspace_keeps_its_runs_and_models_in_that_workspace(server, dataset, step_env, monkeypatch,  # noqa: F811
                                                                              tmp_path):
    import mlflow

    from elastic_step.components import export_model, promote_model, train_elastic

    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    mlflow.set_tracking_uri(server.uri)
    mlflow.create_workspace(WORKSPACE)
    # KFP's API server and driver, in the profile's workspace: the pipeline run and the task run.
    monkeypatch.setenv("MLFLOW_WORKSPACE", WORKSPACE)
    client = MlflowClient(server.uri)
    experiment_id = client.create_experiment("kfp-workspace")
    parent = client.create_run(experiment_id).info.run_id

    def task_env(task: str) -> dict[str, str]:
        run = client.create_run(experiment_id, tags={"mlflow.parentRunId": parent})
        return {"KFP_POD_NAME": f"run-1-{task}", "MLFLOW_TRACKING_URI": server.uri, "MLFLOW_WORKSPACE": WORKSPACE,
                "MLFLOW_RUN_ID": run.info.run_id, "MLFLOW_EXPERIMENT_ID": experiment_id}

    step_env(**(train_task := task_env("train-elastic")))
    model = Model(uri=str(tmp_path / "model"))
    train_elastic.python_func(dataset=dataset, model=model, metrics=Metrics(uri=str(tmp_path / "metrics")),
                              report=HTML(uri=str(tmp_path / "report.html")), workers="2", epochs=1, minibatch_size=32,
                              checkpoint_steps=0, pipeline_run_id="run-1", job_dir=str(tmp_path / "job"))
    step_env(**task_env("export-model"))
    version, _ = export_model.python_func(candidate=model, dataset=dataset, registered_model=REGISTERED,
                                          model_def=MODEL_DEF, pipeline_run_id="run-1")
    step_env(**task_env("promote-model"))
    assert promote_model.python_func(registered_model=REGISTERED, version=version)[0] == version

    run_id = model.metadata["mlflow_run_id"]
    run = client.get_run(run_id)  # in the workspace: the training run, under the task's run
    assert run.data.tags["mlflow.parentRunId"] == train_task["MLFLOW_RUN_ID"] and run.info.experiment_id == experiment_id
    assert client.get_model_version_by_alias(REGISTERED, "champion").run_id == run_id
    monkeypatch.delenv("MLFLOW_WORKSPACE")  # the default workspace sees none of it
    with pytest.raises(MlflowException, match="not found"):
        client.get_run(run_id)
    with pytest.raises(MlflowException, match="RESOURCE_DOES_NOT_EXIST|not found"):
        client.get_registered_model(REGISTERED)
