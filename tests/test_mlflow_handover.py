"""MLflow the way KFP hands it over, against a real MLflow server with basic auth on.

KFP's MLflow integration (kubeflow/pipelines, proposal 12862) is played here as its API server
and driver do it: the API server creates the experiment and a parent run per pipeline run; for
each task the driver creates a nested run (tag mlflow.parentRunId) and sets on the task's
container MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_ID, MLFLOW_RUN_ID (the task's nested run) and
the credentials MLFLOW_TRACKING_USERNAME/PASSWORD from a Secret; KFP's driver also sets
KFP_POD_NAME on every task container. The components run as the task's process does, with
exactly that environment. MLFLOW_WORKSPACE is left out here (it needs a server with workspaces
on, and MLflow's client sends it itself): tests/test_tracking_workspace.py holds it.
"""

from __future__ import annotations

import json
import socket
import threading

import pytest
from kfp.dsl import HTML, ClassificationMetrics, Dataset, Markdown, Metrics, Model
from mlflow.tracking import MlflowClient

from elastic_step.errors import ConfigError
from elastic_step.tracking.handover import Runner, pipeline_runner, step_tracking_uri
from mlflow_server import MlflowServer

MODEL_DEF = "elastic_step.model_zoo.digits_torch"
STEP_ENV = ("KFP_POD_NAME", "ARGO_CONTAINER_NAME", "ARGO_WORKFLOW_NAME", "KFP_RUN_ID", "MLFLOW_TRACKING_URI",
            "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "MLFLOW_RUN_ID",
            "MLFLOW_EXPERIMENT_ID", "MLFLOW_WORKSPACE")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    mlflow = MlflowServer(str(tmp_path_factory.mktemp("mlflow-kfp")), auth=True)
    mlflow.start()
    mlflow.pipelines_password = mlflow.create_user("pipelines")  # the user of the MLflow Secret
    yield mlflow
    mlflow.stop()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Dataset:
    from elastic_step.components import prepare_data

    folder = tmp_path_factory.mktemp("prepared")
    data = Dataset(uri=str(folder / "dataset"))
    prepare_data.python_func(source="sklearn:digits", dataset=data, summary=Markdown(uri=str(folder / "summary.md")),
                             rows_per_shard=256)
    return data


@pytest.fixture
def step_env(monkeypatch):
    """A clean environment for a step, set as a pod's would be."""
    for name in STEP_ENV:
        monkeypatch.delenv(name, raising=False)

    def set_env(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)

    return set_env


class KfpMlflow:
    """KFP's API server and driver, as far as MLflow sees them (with the Secret's user)."""

    def __init__(self, server: MlflowServer, monkeypatch):
        for name, value in server.credentials_env("pipelines", server.pipelines_password).items():
            monkeypatch.setenv(name, value)
        self.server = server
        self.client = MlflowClient(server.uri)
        self.experiment_id = self.client.create_experiment(f"kfp-{id(self)}")
        self.parent = self.client.create_run(self.experiment_id, tags={"kfp.pipeline_run_id": "run-1"}).info.run_id

    def task_env(self, task: str) -> dict[str, str]:
        """The nested run the driver opens for `task`, and the env it sets on the task's container."""
        run = self.client.create_run(self.experiment_id, tags={"mlflow.parentRunId": self.parent, "kfp.task_name": task})
        return {"KFP_POD_NAME": f"run-1-{task}", "MLFLOW_RUN_ID": run.info.run_id,
                "MLFLOW_EXPERIMENT_ID": self.experiment_id,
                **self.server.credentials_env("pipelines", self.server.pipelines_password)}


def test_under_kfps_mlflow_runs_the_steps_nest_under_their_task_runs_and_find_the_training_run(
        server, dataset, step_env, monkeypatch, tmp_path):
    from elastic_step.components import evaluate_model, export_model, promote_model, train_elastic

    kfp = KfpMlflow(server, monkeypatch)
    step_env(**(train_task := kfp.task_env("train-elastic")))
    model = Model(uri=str(tmp_path / "model"))
    train_elastic.python_func(dataset=dataset, model=model, metrics=Metrics(uri=str(tmp_path / "metrics")),
                              report=HTML(uri=str(tmp_path / "report.html")), workers="2", epochs=2, minibatch_size=32,
                              checkpoint_steps=0, pipeline_run_id="run-1", job_dir=str(tmp_path / "job"))
    run = kfp.client.get_run(model.metadata["mlflow_run_id"])
    # A child of the task's run, in KFP's experiment (not the `experiment` parameter's), not the task run itself
    assert run.info.run_id != train_task["MLFLOW_RUN_ID"] and run.info.status == "FINISHED"
    assert run.data.tags["mlflow.parentRunId"] == train_task["MLFLOW_RUN_ID"]
    assert run.info.experiment_id == kfp.experiment_id
    task_run = kfp.client.get_run(train_task["MLFLOW_RUN_ID"])
    assert "elastic_step.job" not in task_run.data.tags and task_run.data.tags["mlflow.parentRunId"] == kfp.parent
    trained = kfp.client.search_runs([kfp.experiment_id], "tags.`elastic_step.job` = 'train-elastic'")
    assert [r.info.run_id for r in trained] == [run.info.run_id]  # one training run, no duplicate

    step_env(**(evaluate_task := kfp.task_env("evaluate-model")))
    blessed, reason = evaluate_model.python_func(
        candidate=model, dataset=dataset, registered_model="handover", model_def=MODEL_DEF,
        metrics=Metrics(uri=str(tmp_path / "eval-metrics")),
        classification=ClassificationMetrics(uri=str(tmp_path / "classification")),
        report=Markdown(uri=str(tmp_path / "gate.md")), floors={"accuracy": 0.5})
    assert blessed, reason
    evaluation = kfp.client.search_runs([kfp.experiment_id], "tags.`elastic_step.gate` = 'evaluation'")
    assert len(evaluation) == 1
    assert evaluation[0].data.tags["mlflow.parentRunId"] == evaluate_task["MLFLOW_RUN_ID"]
    assert evaluation[0].data.tags["elastic_step.gate.candidate_run_id"] == run.info.run_id
    evaluate_run = kfp.client.get_run(evaluate_task["MLFLOW_RUN_ID"])
    assert evaluate_run.data.tags["mlflow.parentRunId"] == kfp.parent  # KFP's tree is left as KFP made it
    assert "elastic_step.gate" not in evaluate_run.data.tags

    step_env(**kfp.task_env("export-model"))
    version, _ = export_model.python_func(candidate=model, dataset=dataset, registered_model="handover",
                                          model_def=MODEL_DEF, pipeline_run_id="run-1")
    step_env(**kfp.task_env("promote-model"))
    champion, _ = promote_model.python_func(registered_model="handover", version=version)
    assert champion == version
    assert kfp.client.get_model_version_by_alias("handover", "champion").run_id == run.info.run_id


def test_a_pipeline_step_without_a_tracking_uri_refuses_in_one_line(dataset, step_env, tmp_path):
    from elastic_step.components import train_elastic

    step_env(KFP_POD_NAME="run-1-train-elastic")
    with pytest.raises(SystemExit) as exit_:
        train_elastic.python_func(dataset=dataset, model=Model(uri=str(tmp_path / "model")),
                                  metrics=Metrics(uri=str(tmp_path / "metrics")), report=HTML(uri=str(tmp_path / "r.html")),
                                  workers="1", epochs=1, job_dir=str(tmp_path / "job"))
    assert exit_.value.code == 2
    assert not (tmp_path / "job" / "mlflow.db").exists()  # nothing written to a pod-local store


def test_an_argo_step_without_a_tracking_uri_exits_2_and_a_local_train_keeps_its_sqlite(dataset, tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in STEP_ENV}
    command = [sys.executable, "-m", "elastic_step.cli", "train", "--data", dataset.path, "--workers", "1",
               "--epochs", "1", "--model-def", MODEL_DEF]
    refused = subprocess.run([*command, "--job-dir", str(tmp_path / "argo")], capture_output=True, text=True,
                             env={**env, "ARGO_CONTAINER_NAME": "main", "ARGO_WORKFLOW_NAME": "wf-1"}, timeout=300)
    assert refused.returncode == 2, refused.stderr
    assert "no MLflow tracking URI in this Argo step" in refused.stderr.strip().splitlines()[-1]
    assert "Traceback" not in refused.stderr
    assert not (tmp_path / "argo" / "mlflow.db").exists()
    assert step_tracking_uri(None, env) is None  # outside a pipeline, the job folder's SQLite stays the default


class Listener:
    """A host a submitter controls: counts what connects to it."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.uri = f"http://pipelines:x@127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self):
        self.stopped.set()
        self.thread.join(5)
        self.sock.close()


def test_a_submitter_supplied_uri_never_receives_the_password(server, dataset, step_env, tmp_path):
    from elastic_step.components import evaluate_model, train_elastic

    evil = Listener()
    try:
        for runner_env in ({"KFP_POD_NAME": "run-1-train"}, {"ARGO_CONTAINER_NAME": "main"}):
            step_env(**runner_env, **server.credentials_env("pipelines", server.pipelines_password))
            with pytest.raises(SystemExit) as exit_:
                train_elastic.python_func(dataset=dataset, model=Model(uri=str(tmp_path / "model")),
                                          metrics=Metrics(uri=str(tmp_path / "m")), report=HTML(uri=str(tmp_path / "r")),
                                          workers="1", epochs=1, mlflow_uri=evil.uri, job_dir=str(tmp_path / "job"))
            assert exit_.value.code == 2
            with pytest.raises(ConfigError, match="came with this step's MLflow credentials"):
                evaluate_model.python_func(
                    candidate=Model(uri=str(tmp_path / "none"), metadata={"mlflow_run_id": "0" * 32}), dataset=dataset,
                    registered_model="handover", model_def=MODEL_DEF, metrics=Metrics(uri=str(tmp_path / "em")),
                    classification=ClassificationMetrics(uri=str(tmp_path / "c")), report=Markdown(uri=str(tmp_path / "g")),
                    mlflow_uri=evil.uri)
        assert evil.connections == 0
    finally:
        evil.close()


def test_which_runner_a_step_runs_under():
    assert pipeline_runner({}) is None
    assert pipeline_runner({"KFP_POD_NAME": "p"}) is Runner.KFP
    assert pipeline_runner({"ARGO_CONTAINER_NAME": "main"}) is Runner.ARGO
    # the URI that came with the credentials is the one used, given again or not
    env = {"KFP_POD_NAME": "p", "MLFLOW_TRACKING_URI": "http://mlflow:5000", "MLFLOW_TRACKING_PASSWORD": "s"}
    assert step_tracking_uri("", env) == "http://mlflow:5000" and step_tracking_uri("http://mlflow:5000/", env)


def test_argo_steps_with_credentials_take_the_uri_from_the_credentials_secret_never_from_a_parameter():
    import yaml

    from elastic_step.argo import RenderOptions
    from elastic_step.argo.render import render_texts

    checked = 0
    for name, text in render_texts(["training", "retraining"], RenderOptions(mlflow_credentials="mlflow-pipelines")).items():
        doc = yaml.safe_load(text)
        spec = doc["spec"].get("workflowSpec", doc["spec"])
        assert "mlflow-uri" not in {p["name"] for p in spec.get("arguments", {}).get("parameters", [])}, name
        for container in [t["container"] for t in spec.get("templates", []) if "container" in t]:
            checked += 1
            env = {e["name"]: e for e in container["env"]}
            for variable, key in (("MLFLOW_TRACKING_URI", "uri"), ("MLFLOW_TRACKING_USERNAME", "username"),
                                  ("MLFLOW_TRACKING_PASSWORD", "password")):
                assert env[variable] == {"name": variable, "valueFrom": {"secretKeyRef": {"name": "mlflow-pipelines", "key": key}}}
            assert "workflow.parameters" not in json.dumps([e for e in container["env"] if e["name"].startswith("MLFLOW_")])
    assert checked >= 10  # every step of both pipelines


@pytest.mark.parametrize("pipeline", ["training_pipeline", "retraining_pipeline"])
def test_compiled_kfp_tasks_take_mlflows_uri_and_user_from_one_fixed_secret(pipeline):
    """kfp-kubernetes' secretAsEnv, as KFP's driver applies it: every task that calls MLflow gets
    MLFLOW_TRACKING_URI, _USERNAME and _PASSWORD from the Secret `mlflow-credentials`, named by a
    constant (runtimeValue), never by a run's parameter; the data step gets nothing of it."""
    import yaml

    from elastic_step.pipelines.compile import PIPELINES_DIR

    docs = list(yaml.safe_load_all((PIPELINES_DIR / "compiled" / f"{pipeline}.yaml").read_text()))
    executors = next(d for d in docs if "platforms" in d)["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    expected = {"uri": "MLFLOW_TRACKING_URI", "username": "MLFLOW_TRACKING_USERNAME", "password": "MLFLOW_TRACKING_PASSWORD"}
    with_mlflow = set()
    for executor, config in executors.items():
        for secret in config.get("secretAsEnv", []):
            mapping = {k["secretKey"]: k["envVar"] for k in secret["keyToEnv"]}
            if any(env.startswith("MLFLOW_") for env in mapping.values()):
                assert mapping == expected and secret["optional"] is True, executor
                assert secret["secretNameParameter"] == {"runtimeValue": {"constant": "mlflow-credentials"}}, executor
                with_mlflow.add(executor)
    assert with_mlflow == {f"exec-{t}" for t in ("train-elastic", "evaluate-model", "export-model", "promote-model",
                                                  "deploy-model")}


def test_the_kfp_example_takes_the_uri_from_the_same_secret_as_the_password(tmp_path):
    from kfp_example import compiled_example

    docs = compiled_example(tmp_path)
    [executor] = next(d for d in docs if "platforms" in d)["platforms"]["kubernetes"]["deploymentSpec"]["executors"].values()
    [secret] = executor["secretAsEnv"]
    assert {k["envVar"]: k["secretKey"] for k in secret["keyToEnv"]} == {
        "MLFLOW_TRACKING_URI": "uri", "MLFLOW_TRACKING_USERNAME": "username", "MLFLOW_TRACKING_PASSWORD": "password"}
    assert "MLFLOW_TRACKING_URI" not in json.dumps(next(d for d in docs if "deploymentSpec" in d))  # no literal env


def test_local_workers_never_get_the_masters_mlflow_credentials(tmp_path, monkeypatch):
    """The worker command is replaced by one that writes its environment to the worker's log."""
    import os
    import time

    from elastic_step.backends.api import LaunchSpec
    from elastic_step.backends.local import LocalBackend
    from elastic_step.protocol import WorkerEnv

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "pipelines")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "a-password")
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "a-token")
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\nenv\n")
    fake_python.chmod(0o755)
    backend = LocalBackend(LaunchSpec("http://127.0.0.1:1", str(tmp_path / "token"), str(tmp_path)), python=str(fake_python))
    backend.launch(0, "w0.1")
    deadline = time.monotonic() + 30
    while not backend.poll() and time.monotonic() < deadline:
        time.sleep(0.1)
    environment = open(os.path.join(tmp_path, "logs", "w0.1.log")).read()
    assert f"{WorkerEnv.WORKER_ID.value}=w0.1" in environment.splitlines()  # it is the worker's environment
    assert "a-password" not in environment and "a-token" not in environment and "MLFLOW_TRACKING_USERNAME" not in environment
