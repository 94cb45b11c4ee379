"""The pipelines deploy the new champion only after it was promoted, and only when asked: in the
compiled KFP IR the deploy_model task sits under the gate's `blessed` condition and a
`serve_target` condition, and it deploys the exact version promote_model made champion."""

from __future__ import annotations

import os

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def path_to(components: dict, dag_name: str, task_name: str, conditions=()) -> tuple | None:
    """The conditions on the way from `dag_name` down to the task `task_name`, and the task."""
    for name, task in components[dag_name].get("dag", {}).get("tasks", {}).items():
        here = conditions + ((task["triggerPolicy"]["condition"],) if "triggerPolicy" in task else ())
        if name == task_name:
            return here, task
        ref = task["componentRef"]["name"]
        if "dag" in components[ref]:
            found = path_to(components, ref, task_name, here)
            if found:
                return found
    return None


@pytest.mark.parametrize("name", ["training_pipeline", "retraining_pipeline"])
def test_deploy_runs_only_for_a_promoted_candidate_and_a_serve_target(name):
    spec = next(yaml.safe_load_all(open(os.path.join(ROOT, "pipelines", "compiled", f"{name}.yaml"))))
    components = {**spec["components"], "root": spec["root"]}
    conditions, task = path_to(components, "root", "deploy-model")
    assert conditions == ("inputs.parameter_values['pipelinechannel--blessed'] == true",
                          "inputs.parameter_values['pipelinechannel--serve_target'] != ''")
    assert task["inputs"]["parameters"]["version"] == {"componentInputParameter": "pipelinechannel--promote-model-champion_version"}
    assert spec["root"]["inputDefinitions"]["parameters"]["serve_target"]["defaultValue"] == ""  # promote only, unless asked


@pytest.mark.parametrize("name", ["training", "retraining"])
def test_the_argo_workflow_deploys_only_a_promoted_champion_and_only_when_a_run_asks(name):
    """The Argo step as `make compile` renders it: after promote succeeded, under evaluate's verdict
    and a non-empty serve-target (its default promotes only), with promote's champion version."""
    template = yaml.safe_load(open(os.path.join(ROOT, "pipelines", "argo", f"{name}-workflowtemplate.yaml")))
    spec = template["spec"]
    (dag,) = [t["dag"] for t in spec["templates"] if t["name"] == name]
    (task,) = [t for t in dag["tasks"] if t["name"] == "deploy"]
    assert task["depends"] == "promote.Succeeded"
    assert task["when"] == ("{{tasks.evaluate.outputs.parameters.blessed}} == true && "
                            "'{{workflow.parameters.serve-target}}' != ''")
    arguments = {p["name"]: p["value"] for p in task["arguments"]["parameters"]}
    assert arguments["version"] == "{{tasks.promote.outputs.parameters.champion_version}}"
    assert arguments["target"] == "{{workflow.parameters.serve-target}}"
    defaults = {p["name"]: p["value"] for p in spec["arguments"]["parameters"]}
    assert defaults["serve-target"] == ""
    (container,) = [t["container"] for t in spec["templates"] if t["name"] == "deploy"]
    args = container["args"]
    assert args[:5] == ["deploy", "--registered-model", "{{inputs.parameters.registered-model}}", "--version",
                        "{{inputs.parameters.version}}"]
    assert args[args.index("--image") + 1] == container["image"]  # the server image fixed at render time
