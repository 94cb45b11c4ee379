"""Step pods pass Pod Security Standards' `restricted` level, as the cluster stand-in's PodSecurity
admission judges a pod (tests/cluster/admission.py, from Kubernetes' pod-security-admission
policy, in its words): the train step's pod is the elastic master and holds
the runner's token, and a Kubeflow profile namespace or any namespace labelled
`pod-security.kubernetes.io/enforce: restricted` refuses a pod that does not.

Argo: every container template of both rendered WorkflowTemplates, in every file layout, becomes
the pod Argo's controller makes of it (tests/cluster/argo.py `step_pod`: init, wait, main), with
the controller's `executor.securityContext` on init and wait as `newExecContainer`
(workflow/controller/workflowpod.go) copies it. KFP: every task of both compiled pipelines runs as
the image's non-root user; KFP's compiler adds no privilege escalation, dropped capabilities and
RuntimeDefault seccomp itself (kfp-kubernetes 2.17, `set_security_context`), which is not played
here. The worker pods the master creates pass too."""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from cluster.argo import step_pod
from elastic_step.argo import RenderOptions, build_documents
from elastic_step.argo.security import EXECUTOR_SECURITY_CONTEXT
from elastic_step.backends.kubernetes.manifests import dry_run_manifests
from elastic_step.backends.kubernetes.options import MasterPod, settings_from_config
from elastic_step.config import TrainConfig
from elastic_step.images import IMAGE_USER
from elastic_step.pipelines.compile import PIPELINES, PIPELINES_DIR
from cluster.admission import pod_security_failures

# What earlier tasks of the DAG hand the later steps, so every template resolves.
OUTPUTS = {"tasks.train.outputs.parameters.run_id": "r1", "tasks.train.outputs.parameters.model_uri": "runs:/r1/model",
           "tasks.evaluate.outputs.parameters.blessed": "true", "tasks.export.outputs.parameters.model_version": "3",
           "tasks.promote.outputs.parameters.champion_version": "3"}
DATASET = {"dataset": {"bucket": "artifacts", "key": "wf/prepare-data/dataset", "endpoint": "http://minio:9000"}}
LAYOUTS = {"artifacts": {}, "pvc": {"pvc": "shared-work"}, "data-store": {"data_store": "s3://bucket/prefix"}}


def violations(pod: dict, level: str = "restricted") -> list[str]:
    """`reason (detail)` of every check of `level` the pod fails; empty: admitted."""
    return pod_security_failures(pod["spec"], level)


def reasons(pod: dict, level: str = "restricted") -> set[str]:
    return {failure.split(" (", 1)[0] for failure in violations(pod, level)}


def rendered(pipeline: str, **options) -> dict:
    return build_documents(pipeline, RenderOptions(**options))[f"{pipeline}-workflowtemplate.yaml"].to_dict()


def step_pods(document: dict, executor_security: dict | None) -> dict[str, dict]:
    """Template name → the pod Argo's controller creates for it, with the controller configured
    with `executor_security` (None: no `executor.securityContext` in its ConfigMap)."""
    pods = {}
    for template in document["spec"]["templates"]:
        if "container" not in template:
            continue  # the DAG: no pod of its own
        pod = step_pod(copy.deepcopy(document), template["name"], "wf", OUTPUTS, {}, DATASET)
        for container in pod["spec"]["initContainers"] + pod["spec"]["containers"]:
            if container["name"] in ("init", "wait") and executor_security is not None:
                container["securityContext"] = copy.deepcopy(executor_security)
        pods[template["name"]] = pod
    return pods


@pytest.mark.parametrize("pipeline", ["training", "retraining"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_argo_step_pod_passes_podsecurity_restricted(pipeline, layout):
    pods = step_pods(rendered(pipeline, **LAYOUTS[layout]), EXECUTOR_SECURITY_CONTEXT)
    assert set(pods) == {"prepare-data", "train", "evaluate", "export", "promote", "deploy"}
    found = {name: violations(pod) for name, pod in pods.items()}
    assert found == {name: [] for name in pods}, json.dumps(found, indent=1)
    main = pods["train"]["spec"]["containers"][1]
    assert main["name"] == "main" and main["securityContext"]["runAsUser"] == IMAGE_USER


def test_argos_own_containers_need_the_controllers_executor_security_context():
    """The template sets the pod's user and seccomp profile, which cover init and wait; privilege
    escalation and capabilities are per container, and Argo takes those of its own containers
    from its ConfigMap only. Without it, restricted refuses exactly those two, for those two."""
    found = violations(step_pods(rendered("training"), None)["train"])
    assert found == [
        'allowPrivilegeEscalation != false (containers "init", "wait" must set securityContext.allowPrivilegeEscalation=false)',
        'unrestricted capabilities (containers "init", "wait" must set securityContext.capabilities.drop=["ALL"])'], found


def test_the_checks_refuse_a_step_pod_without_the_hardening():
    """The check is not vacuous: the same template with no securityContext fails restricted on
    each of the four settings, and a privileged main fails baseline too."""
    document = rendered("training")
    del document["spec"]["securityContext"]
    for template in document["spec"]["templates"]:
        template.get("container", {}).pop("securityContext", None)
    pod = step_pods(document, None)["train"]
    assert reasons(pod) == {"allowPrivilegeEscalation != false", "runAsNonRoot != true", "seccompProfile",
                            "unrestricted capabilities"}
    assert violations(pod, "baseline") == []
    pod["spec"]["containers"][1]["securityContext"] = {"privileged": True, "runAsUser": 0}
    pod["spec"]["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    assert reasons(pod, "baseline") == {"privileged", "hostPath volumes"}
    assert {"runAsUser=0", "restricted volume types"} <= reasons(pod)


@pytest.mark.parametrize("name", PIPELINES)
def test_every_kfp_task_runs_as_the_images_non_root_user(name):
    platform = list(yaml.safe_load_all((PIPELINES_DIR / "compiled" / f"{name}.yaml").read_text()))[1]
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    spec = list(yaml.safe_load_all((PIPELINES_DIR / "compiled" / f"{name}.yaml").read_text()))[0]
    assert set(executors) == set(spec["deploymentSpec"]["executors"]), "every task's executor has kubernetes settings"
    for executor, settings in executors.items():
        assert settings.get("securityContext") == {"runAsUser": str(IMAGE_USER), "runAsGroup": str(IMAGE_USER),
                                                   "runAsNonRoot": True}, executor


def test_worker_pods_pass_podsecurity_restricted(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_STEP_POD_NAMESPACE", "ml")
    config = TrainConfig(model_def="elastic_step.model_zoo.digits_torch", data="s3://bucket/ds", job_dir=str(tmp_path),
                         workers="2", backend="kubernetes", worker_gpus=1, host="10.0.0.5")
    settings = settings_from_config(config)
    master = MasterPod(name="m", uid="u", ip="10.0.0.5", namespace="ml")
    pods = [o for o in yaml.safe_load_all(dry_run_manifests(config, settings, master, "img:1")) if o and o["kind"] == "Pod"]
    assert len(pods) == 2 and all(violations(pod) == [] for pod in pods), [violations(p) for p in pods]
