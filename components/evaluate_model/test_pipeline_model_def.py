"""The gate and export of both pipelines (KFP and Argo) load the candidate's weights into the
network of the pipeline's own model definition parameter, never into what the training run's
`model_def` parameter in MLflow names: a writer to MLflow who points that parameter at code of
their own gets nothing imported. The planted run below names a .py file that makes a folder when
imported; every step must leave no such folder and record the pipeline's model definition."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml
from kfp.dsl import ClassificationMetrics, Markdown, Metrics, Model
from mlflow.tracking import MlflowClient

from elastic_step import defaults
from elastic_step.errors import ConfigError
from elastic_step.frameworks.model_def import load_model_definition
from elastic_step.frameworks.registry import build_trainer
from elastic_step.frameworks.weights import FINAL_MODEL_ARTIFACTS
from elastic_step.tracking.run import connect

ROOT = Path(__file__).resolve().parents[2]
MODEL_DEF = defaults.MODEL_DEF  # what both pipelines pass when nothing is set


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A finished training run with real weights of MODEL_DEF's network, whose `model_def`
    parameter an attacker changed to a file of their own."""
    folder = tmp_path_factory.mktemp("planted-model-def")
    uri = f"sqlite:///{folder}/mlflow.db"
    connect(uri, str(folder))
    marker = folder / "attacker-code-ran"
    attacker = folder / "attacker_model.py"
    attacker.write_text(f"import os\nos.mkdir({str(marker)!r})\n")
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("planted-model-def")).info.run_id
    client.log_param(run_id, "model_def", str(attacker))
    weights = folder / "weights"
    weights.mkdir()
    (weights / "model.bin").write_bytes(build_trainer(load_model_definition(MODEL_DEF), seed=1).model_bytes())
    client.log_artifacts(run_id, str(weights), FINAL_MODEL_ARTIFACTS)
    client.set_terminated(run_id)
    yield {"uri": uri, "run_id": run_id, "model_uri": f"runs:/{run_id}/model", "marker": marker, "attacker": attacker,
           "client": client}


def test_the_planted_model_definition_does_run_code_when_imported(planted):
    # The control: importing what the run's parameter names runs the attacker's code, so a step
    # that fell back to it would leave the folder the tests below look for.
    with pytest.raises(Exception):
        load_model_definition(str(planted["attacker"]))
    assert planted["marker"].is_dir()
    planted["marker"].rmdir()


# ---- KFP ----------------------------------------------------------------------------------------

def _compiled(name: str) -> dict:
    return next(yaml.safe_load_all((ROOT / "pipelines" / "compiled" / f"{name}.yaml").read_text()))


def _tasks(spec: dict) -> dict:
    """Every task of the pipeline and of its sub-DAGs: task name → (the component whose DAG holds it, the task)."""
    dags = [("root", spec["root"])] + [(name, c) for name, c in spec["components"].items() if "dag" in c]
    return {task_name: (owner, task) for owner, component in dags for task_name, task in component["dag"]["tasks"].items()}


def _source_of(spec: dict, owner: str, name: str) -> str:
    """Follow a task's input parameter up through the DAGs that hold it to the root parameter it comes from."""
    tasks = _tasks(spec).values()
    while owner != "root":
        # the task that runs the sub-DAG `owner` gives it `name` from its own DAG's inputs
        parent, task = next((o, t) for o, t in tasks if t["componentRef"]["name"] == owner)
        name = task["inputs"]["parameters"][name]["componentInputParameter"]
        owner = parent
    return name


@pytest.mark.parametrize("pipeline", ["training_pipeline", "retraining_pipeline"])
def test_the_compiled_gate_and_export_take_the_pipelines_model_def(pipeline):
    spec = _compiled(pipeline)
    tasks = _tasks(spec)
    for task_name in ("train-elastic", "evaluate-model", "export-model"):
        owner, task = tasks[task_name]
        parameter = task["inputs"]["parameters"]["model_def"]["componentInputParameter"]
        assert _source_of(spec, owner, parameter) == "model_def", task_name
    assert spec["root"]["inputDefinitions"]["parameters"]["model_def"]["defaultValue"] == MODEL_DEF


def _candidate(planted) -> Model:
    candidate = Model(uri=planted["model_uri"])
    candidate.metadata.update({"mlflow_run_id": planted["run_id"], "model_uri": planted["model_uri"]})
    return candidate


def test_the_gate_and_export_components_use_the_model_def_they_are_given(planted, dataset, tmp_path):
    from elastic_step.components import evaluate_model, export_model

    outputs = dict(metrics=Metrics(uri=str(tmp_path / "m")), classification=ClassificationMetrics(uri=str(tmp_path / "c")),
                   report=Markdown(uri=str(tmp_path / "report.md")))
    gate = evaluate_model.python_func(candidate=_candidate(planted), dataset=dataset, registered_model="planted-kfp",
                                      model_def=MODEL_DEF, floors={"accuracy": 0.0}, mlflow_uri=planted["uri"], **outputs)
    assert gate.blessed is True and not planted["marker"].exists()
    exported = export_model.python_func(candidate=_candidate(planted), dataset=dataset, registered_model="planted-kfp",
                                        model_def=MODEL_DEF, mlflow_uri=planted["uri"])
    assert not planted["marker"].exists()
    version = planted["client"].get_model_version("planted-kfp", exported.model_version)
    assert version.tags["model_def"] == MODEL_DEF


def test_an_empty_model_def_is_refused_not_taken_from_the_run(planted, dataset):
    from elastic_step.components import export_model

    with pytest.raises(ConfigError, match="model definition is empty"):
        export_model.python_func(candidate=_candidate(planted), dataset=dataset, registered_model="planted-empty",
                                 model_def=" ", mlflow_uri=planted["uri"])
    assert not planted["marker"].exists()


# ---- Argo ---------------------------------------------------------------------------------------

REF = re.compile(r"\{\{\s*([a-zA-Z0-9_.\-]+)\s*\}\}")


def _argo_command(step: str, planted, data: str, outputs: Path, parameters: dict,
                  monkeypatch: pytest.MonkeyPatch | None = None) -> list[str]:
    """The step's command line as the rendered WorkflowTemplate has Argo run it, for a run of the
    workflow with `parameters` and the train step's outputs naming the planted run; with
    `monkeypatch`, the container's plain env values are set too (the pod's MLFLOW_TRACKING_URI
    comes from the workflow's `mlflow-uri` parameter)."""
    from elastic_step.argo import RenderOptions
    from elastic_step.argo.render import render_texts

    doc = yaml.safe_load(render_texts(["training"], RenderOptions())["training-workflowtemplate.yaml"])
    workflow = {p["name"]: p["value"] for p in doc["spec"]["arguments"]["parameters"]} | parameters
    template = next(t for t in doc["spec"]["templates"] if t["name"] == step)
    dag = next(t for t in doc["spec"]["templates"] if t["name"] == "training")["dag"]["tasks"]
    task_args = {p["name"]: p["value"] for p in next(t for t in dag if t["name"] == step)["arguments"]["parameters"]}
    train_outputs = {"run_id": planted["run_id"], "model_uri": planted["model_uri"]}

    def resolve(text: str) -> str:
        def one(match):
            scope, *rest = match.group(1).split(".")
            if scope == "inputs":
                return resolve(task_args[rest[1]])
            if scope == "workflow":
                return workflow[rest[1]] if rest[0] == "parameters" else "elastic-step-training-abcde"
            if scope == "tasks":
                return train_outputs[rest[-1]]
            raise AssertionError(match.group(0))
        return REF.sub(one, text)

    argv = [resolve(a) for a in template["container"]["args"]]
    if monkeypatch is not None:
        for env in template["container"].get("env", []):
            if "value" in env:
                monkeypatch.setenv(env["name"], resolve(env["value"]))
    argv[argv.index("--data") + 1] = data  # where the artifact would be downloaded to
    argv[argv.index("--outputs") + 1] = str(outputs)
    return argv


def test_the_argo_gate_and_export_steps_use_the_workflows_model_def(planted, dataset, tmp_path, capsys, monkeypatch):
    from elastic_step.cli import main

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # only what the step's pod is given
    parameters = {"registered-model": "planted-argo", "floor": "accuracy=0.0", "mlflow-uri": planted["uri"]}
    argv = _argo_command("evaluate", planted, dataset.path, tmp_path / "evaluate", parameters, monkeypatch)
    assert argv[argv.index("--model-def") + 1] == MODEL_DEF
    assert main(argv) == 0, capsys.readouterr().err
    assert (tmp_path / "evaluate" / "blessed").read_text() == "true"
    assert not planted["marker"].exists()
    argv = _argo_command("export", planted, dataset.path, tmp_path / "export", parameters, monkeypatch)
    assert main(argv) == 0, capsys.readouterr().err
    assert not planted["marker"].exists()
    version = planted["client"].get_model_version("planted-argo", (tmp_path / "export" / "model_version").read_text())
    assert version.tags["model_def"] == MODEL_DEF


@pytest.mark.parametrize("step", ["evaluate", "export"])
def test_the_cli_steps_refuse_to_run_without_a_model_def(planted, dataset, tmp_path, capsys, step):
    from elastic_step.cli import main

    argv = _argo_command(step, planted, dataset.path, tmp_path, {"registered-model": "planted-cli"})
    at = argv.index("--model-def")
    with pytest.raises(SystemExit) as exited:  # argparse: a required flag
        main(argv[:at] + argv[at + 2:])
    assert exited.value.code == 2 and "--model-def" in capsys.readouterr().err
    argv[at + 1] = ""
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "--model-def is empty" in error and len(error.strip().splitlines()) == 1, error
    assert not planted["marker"].exists() and not os.listdir(tmp_path)
