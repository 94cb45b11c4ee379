"""The pipelines deploy the new champion only after it was promoted, and only when asked: in the
compiled KFP IR the deploy_model task sits under the gate's `blessed` condition and a
`serve_target` condition, and it deploys the exact version promote_model made champion. In Argo,
the deploy task's `when`, evaluated as Argo's controller evaluates it (tests/cluster/argowhen.py),
runs it only for a blessed candidate and a serve target; the Workflow stand-in skips it otherwise."""

from __future__ import annotations

import os
import re

import pytest
import yaml

from cluster import Cluster
from cluster.argo import task_when
from cluster.argoretry import NodePhase
from cluster.argowhen import WhenError, should_execute
from cluster.workflow import WorkflowController

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


@pytest.mark.parametrize("when, runs", [
    ("", True),
    ("true == true", True),
    ("false == true", False),
    ("Succeeded == Succeeded", True),  # a bare word is the string it spells
    ("true == 'true'", False),  # govaluate compares type and value: a bool is no string
    ("1 == 1.0", True),
    ("'b' > 'a' && 2 >= 10", False),
    ("!(false) || a != a", True),
    ("true == true && '' != ''", False),
])
def test_a_when_is_evaluated_as_argos_govaluate_does(when, runs):
    assert should_execute(when) is runs


@pytest.mark.parametrize("when, says", [
    ("1", "Expected boolean evaluation for '1'. Got 1"),
    ("mlflow && true", "Value 'mlflow' cannot be used with the logical operator '&&', it is not a bool"),
    ("a - b == c", "Invalid token: '- b == c'"),  # arithmetic is not modelled: refused, never guessed
    ("(true == true", "Unexpected end of expression"),
])
def test_a_when_that_cannot_be_evaluated_is_an_error(when, says):
    with pytest.raises(WhenError, match=re.escape(says)):
        should_execute(when)


def shipped_deploy_when(name: str, blessed: str, serve_target: str) -> str:
    spec = yaml.safe_load(open(os.path.join(ROOT, "pipelines", "argo", f"{name}-workflowtemplate.yaml")))["spec"]
    spec["arguments"]["parameters"] = [{**p, "value": serve_target} if p["name"] == "serve-target" else p
                                       for p in spec["arguments"]["parameters"]]
    return task_when(spec, "deploy", "wf", {"tasks.evaluate.outputs.parameters.blessed": blessed})


@pytest.mark.parametrize("name", ["training", "retraining"])
@pytest.mark.parametrize("blessed, serve_target, runs", [
    ("true", "mlflow", True), ("true", "kserve", True), ("false", "mlflow", False), ("true", "", False),
])
def test_the_shipped_deploy_when_runs_only_a_blessed_candidate_with_a_serve_target(name, blessed, serve_target, runs):
    assert should_execute(shipped_deploy_when(name, blessed, serve_target)) is runs


def test_the_workflow_skips_the_deploy_step_the_gate_refused_without_a_pod(tmp_path):
    """On the stand-in's Workflow controller: evaluate said not blessed, so the deploy task is
    Skipped in Argo's words and no pod is made; a verdict it cannot resolve is the node's Error."""
    template = yaml.safe_load(open(os.path.join(ROOT, "pipelines", "argo", "retraining-workflowtemplate.yaml")))
    with Cluster(str(tmp_path / "cluster")) as cluster:
        controller = WorkflowController(cluster)
        workflow = controller.submit(template, "wf-refused", {"serve-target": "mlflow"})
        node = controller.run_step(workflow, "deploy", {"tasks.evaluate.outputs.parameters.blessed": "false",
                                                        "tasks.promote.outputs.parameters.champion_version": "3"})
        assert (node.phase, node.message, node.attempts) == (
            NodePhase.SKIPPED, "when 'false == true && 'mlflow' != ''' evaluated false", [])
        status = controller.custom.get_namespaced_custom_object("argoproj.io", "v1alpha1", cluster.namespace, "workflows",
                                                                "wf-refused")["status"]
        assert status["phase"] == "Succeeded"  # a skipped task fails nothing
        assert [(n["type"], n["phase"]) for n in status["nodes"].values()] == [("Skipped", "Skipped")]
        unjudged = controller.run_step(controller.submit(template, "wf-unjudged", {"serve-target": "mlflow"}), "deploy", {})
        assert (unjudged.phase, unjudged.message) == (
            NodePhase.ERROR, "failed to resolve {{tasks.evaluate.outputs.parameters.blessed}}")
        assert cluster.core().list_namespaced_pod(cluster.namespace).items == []
