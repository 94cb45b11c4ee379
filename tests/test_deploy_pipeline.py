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
