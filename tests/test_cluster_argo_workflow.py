"""Argo as installed, on the cluster stand-in, with small WorkflowTemplates of our own: the
controller (tests/cluster/workflow.py) makes each attempt's pod owned by its Workflow and retries
it as Argo's retryStrategy says; the executor (tests/cluster/argoexec.py, in the pod's `wait`
container, with the pod's own token) uploads the declared outputs to the artifact repository
configured the way Argo reads it, reports them in a WorkflowTaskResult, and fails the step in
Argo's words when an output is missing or there is no repository. Real pods, a real S3 server
(moto), the API server enforcing deploy/argo's executor Role.

The shipped train step on this controller: tests/test_cluster_argo.py."""

from __future__ import annotations

import io
import tarfile
import time

import pytest
import yaml
from kubernetes import client as k8s

from cluster import Cluster
from cluster.admission import ENFORCE
from cluster.argo import ARGOEXEC_IMAGE, argoexec_image
from cluster.argoretry import NodePhase
from cluster.rbac import REPO, kustomize_namespace, read_manifests
from cluster.runtime import Image, python_paths
from cluster.workflow import DEFAULT_REPOSITORY_ANNOTATION, SkippingClock, WorkflowController, WorkflowFailed
from elastic_step.argo.security import EXECUTOR_SECURITY_CONTEXT
from stores import S3Server

pytestmark = pytest.mark.e2e

SHELL_IMAGE = "busybox:1.36"
RUNNER = "elastic-step-runner"  # deploy/rbac's account, bound to deploy/argo's executor Role
S3_KEYS = "argo-artifacts-s3"  # the repository's Secret, as Argo's docs name its keys
EXECUTOR_PATCH = f"{REPO}/deploy/argo/controller/executor-patch.yaml"  # for the controller's ConfigMap
NOT_CONFIGURED = "artifact storage is not configured; see the docs for setup instructions"


@pytest.fixture(scope="module")
def s3():
    with S3Server() as server:
        server.create_bucket("argo-artifacts")
        yield server


@pytest.fixture
def cluster(tmp_path):
    # A shell image; it carries this machine's Python only because the executor's emissary, which
    # main runs from /var/run/argo, is a Python script here (Argo's is a static binary).
    shell = Image(SHELL_IMAGE, {"PATH": "/usr/bin:/bin"}, uid=1000, gid=1000, workdir="/", home="/home/user", paths=python_paths())
    images = {SHELL_IMAGE: shell,
              ARGOEXEC_IMAGE: argoexec_image(str(tmp_path / "argoexec"))}
    with Cluster(str(tmp_path / "cluster"), images=images) as c:
        print(f"kubelet runtime: {c.kubelet.mode}")
        for obj in kustomize_namespace(read_manifests(f"{REPO}/deploy/argo"), c.namespace):
            c.authorizer.apply(obj)
        c.core().create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name="argo")))
        yield c


def repository(s3: S3Server, **extra) -> str:
    """An S3 artifact repository as the `artifact-repositories` ConfigMap holds it."""
    host = s3.endpoint.removeprefix("http://")
    return yaml.safe_dump({"s3": {"bucket": "argo-artifacts", "endpoint": host, "insecure": True,
                                  "accessKeySecret": {"name": S3_KEYS, "key": "accesskey"},
                                  "secretKeySecret": {"name": S3_KEYS, "key": "secretkey"}, **extra}})


def add_repository(cluster: Cluster, s3: S3Server, namespace: str | None = None, name: str = "artifact-repositories",
                   key: str = "default-v1-s3") -> None:
    api, ns = cluster.core(), namespace or cluster.namespace
    if name == "artifact-repositories":
        body = k8s.V1ConfigMap(metadata=k8s.V1ObjectMeta(name=name, annotations={DEFAULT_REPOSITORY_ANNOTATION: key}),
                               data={key: repository(s3, keyFormat="runs/{{workflow.name}}/{{pod.name}}")})
    else:  # the controller's own ConfigMap
        body = k8s.V1ConfigMap(metadata=k8s.V1ObjectMeta(name=name), data={"artifactRepository": repository(s3)})
    api.create_namespaced_config_map(ns, body)
    api.create_namespaced_secret(cluster.namespace, k8s.V1Secret(metadata=k8s.V1ObjectMeta(name=S3_KEYS),
                                                                 string_data={"accesskey": "AKIDTEST", "secretkey": "not-a-real-secret"}))


def template(name: str, script: str, outputs: dict | None = None, retry: dict | None = None, **more) -> dict:
    step = {"name": "step", "container": {"image": SHELL_IMAGE, "command": ["sh", "-c", script],
                                          "resources": {"limits": {"memory": "64Mi"}, "requests": {"cpu": "100m", "memory": "64Mi"}}},
            "outputs": outputs or {}, **({"retryStrategy": retry} if retry else {}), **more}
    return {"apiVersion": "argoproj.io/v1alpha1", "kind": "WorkflowTemplate", "metadata": {"name": name},
            "spec": {"entrypoint": "main", "serviceAccountName": RUNNER, "arguments": {"parameters": [{"name": "greeting", "value": "hi"}]},
                     "templates": [{"name": "main", "dag": {"tasks": [{"name": "step", "template": "step"}]}}, step]}}


def wait_log(cluster: Cluster, pod: str) -> str:
    return cluster.kubelet.read_log(cluster.namespace, pod).decode(errors="replace")


def s3_object(s3: S3Server, key: str) -> bytes:
    return s3.client().get_object(Bucket="argo-artifacts", Key=key)["Body"].read()


OUTPUTS = {"parameters": [{"name": "answer", "valueFrom": {"path": "/tmp/answer"}}],
           "artifacts": [{"name": "report", "path": "/tmp/report.txt"},
                         {"name": "model", "path": "/tmp/model", "archive": {"none": {}}},
                         {"name": "extra", "path": "/tmp/absent", "optional": True}]}
WRITE = "echo 42 > /tmp/answer && echo {{workflow.parameters.greeting}} > /tmp/report.txt && mkdir -p /tmp/model/sub && " \
        "echo w > /tmp/model/weights && echo c > /tmp/model/sub/config && id -u > /tmp/uid"


def test_outputs_are_uploaded_to_the_namespaces_artifact_repository_and_reported_by_a_step_its_workflow_owns(cluster, s3):
    add_repository(cluster, s3)
    controller = WorkflowController(cluster)
    doc = template("outputs", WRITE, OUTPUTS, securityContext={"runAsUser": 4321, "runAsGroup": 4321, "fsGroup": 4321})
    workflow = controller.submit(doc, "wf-out", {"greeting": "hello"})
    node = controller.run_step(workflow, "step")
    pod_name = node.attempts[0].pod
    assert node.phase == NodePhase.SUCCEEDED, (node, wait_log(cluster, pod_name))
    assert node.name == node.attempts[0].name == "wf-out.step"

    assert [p["value"] for p in node.outputs["parameters"]] == ["42"]  # one trailing newline trimmed
    keys = {a["name"]: a["s3"]["key"] for a in node.outputs["artifacts"]}
    prefix = f"runs/wf-out/{pod_name}"  # the repository's keyFormat, resolved
    assert keys == {"report": f"{prefix}/report.tgz", "model": f"{prefix}/model"}  # the optional absent one: none
    with tarfile.open(fileobj=io.BytesIO(s3_object(s3, keys["report"])), mode="r:gz") as tar:
        assert tar.getnames() == ["report.txt"] and tar.extractfile("report.txt").read() == b"hello\n"
    assert s3_object(s3, f"{prefix}/model/weights") == b"w\n" and s3_object(s3, f"{prefix}/model/sub/config") == b"c\n"

    pod = cluster.server.get("pods", cluster.namespace, pod_name)
    owner = pod["metadata"]["ownerReferences"]
    assert owner == [{"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "name": "wf-out", "uid": workflow["metadata"]["uid"],
                      "controller": True, "blockOwnerDeletion": True}]
    assert pod["spec"]["serviceAccountName"] == RUNNER and pod["spec"]["securityContext"]["runAsUser"] == 4321
    main = next(c for c in pod["spec"]["containers"] if c["name"] == "main")
    assert main["resources"]["limits"]["memory"] == "64Mi"
    wait = next(c for c in pod["spec"]["containers"] if c["name"] == "wait")
    assert not any(e.get("valueFrom", {}).get("secretKeyRef") for e in wait["env"])  # the S3 keys come as a volume
    if cluster.kubelet.isolation == "namespaces":
        with open(cluster.kubelet.container_file(cluster.namespace, pod_name, "main", "/tmp/uid")) as f:
            assert f.read().strip() == "4321"
    # The executor reported with the pod's own account, as deploy/argo's Role allows it, no more.
    runner = f"system:serviceaccount:{cluster.namespace}:{RUNNER}"
    assert cluster.used(runner) == {(verb, "workflowtaskresults", cluster.namespace) for verb in ("create", "patch")}
    stored = cluster.server.get("workflows", cluster.namespace, "wf-out")
    assert stored["status"]["phase"] == "Succeeded"

    workflows = k8s.CustomObjectsApi(k8s.ApiClient(cluster.configuration()))
    workflows.delete_namespaced_custom_object("argoproj.io", "v1alpha1", cluster.namespace, "workflows", "wf-out")
    deadline = time.monotonic() + 10
    while (cluster.objects("pods") or cluster.objects("workflowtaskresults")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cluster.objects("pods") == [] and cluster.objects("workflowtaskresults") == []  # garbage-collected with their Workflow


def test_the_controllers_default_repository_serves_a_namespace_without_one_and_no_repository_fails_the_step(cluster, s3):
    controller = WorkflowController(cluster)
    outputs = {"artifacts": [{"name": "report", "path": "/tmp/report.txt"}]}
    nowhere = controller.run_step(controller.submit(template("none", WRITE, outputs), "wf-none", {}), "step")
    assert nowhere.phase == NodePhase.ERROR and nowhere.message == "wait: Error (exit code 1)"
    assert f"executor error: {NOT_CONFIGURED}" in wait_log(cluster, nowhere.attempts[0].pod)

    add_repository(cluster, s3, namespace="argo", name="workflow-controller-configmap")
    named = template("ref", WRITE, outputs)
    named["spec"]["artifactRepositoryRef"] = {"configMap": "team-repositories", "key": "s3"}  # in neither namespace
    with pytest.raises(WorkflowFailed, match='^failed to find any artifact repository for artifact repository ref "team-repositories#s3"$'):
        controller.run_step(controller.submit(named, "wf-ref", {}), "step")
    node = controller.run_step(controller.submit(template("default", WRITE, outputs), "wf-default", {}), "step")
    assert node.phase == NodePhase.SUCCEEDED, wait_log(cluster, node.attempts[0].pod)
    assert node.outputs["artifacts"][0]["s3"]["key"] == f"wf-default/{node.attempts[0].pod}/report.tgz"  # Argo's default key format


def test_a_missing_output_is_an_error_of_the_executor_that_only_OnError_or_Always_retries(cluster, s3):
    add_repository(cluster, s3)
    controller = WorkflowController(cluster)
    missing = {"parameters": [{"name": "answer", "valueFrom": {"path": "/tmp/never"}}],
               "artifacts": [{"name": "model", "path": "/tmp/model"}]}
    node = controller.run_step(controller.submit(template("miss", "true", missing, {"limit": 2, "retryPolicy": "OnFailure"}),
                                                 "wf-miss", {}), "step")
    assert node.phase == NodePhase.ERROR and len(node.attempts) == 1, node
    assert node.message == "wait: Error (exit code 1)" and node.attempts[0].exit_code == "0"
    log = wait_log(cluster, node.attempts[0].pod)
    assert "executor error: open /var/run/argo/outputs/parameters/tmp/never: no such file or directory" in log, log
    assert "executor error: open /var/run/argo/outputs/artifacts/tmp/model.tgz: no such file or directory; " in log, log

    retried = controller.run_step(controller.submit(template("miss2", "true", missing, {"limit": 1, "retryPolicy": "OnError"}),
                                                    "wf-miss2", {}), "step")
    assert [a.phase for a in retried.attempts] == [NodePhase.ERROR, NodePhase.ERROR]
    assert retried.phase == NodePhase.ERROR and retried.message == "No more retries left"
    assert [a.name for a in retried.attempts] == ["wf-miss2.step(0)", "wf-miss2.step(1)"]


def test_a_failed_main_is_retried_after_its_backoff_until_the_expression_says_no(cluster):
    clock = SkippingClock()
    controller = WorkflowController(cluster, clock=clock.now, sleep=clock.sleep)
    retry = {"limit": 4, "expression": "lastRetry.exitCode != '2'", "backoff": {"duration": "5s", "factor": 3}}
    # exit 3 on the first attempt, 2 on the second: bad input, not worth a third
    node = controller.run_step(controller.submit(template("flaky", "exit $((3 - {{retries}}))", None, retry), "wf-flaky", {}), "step")
    assert [(a.phase, a.exit_code, a.message) for a in node.attempts] == [
        (NodePhase.FAILED, "3", "main: Error (exit code 3)"), (NodePhase.FAILED, "2", "main: Error (exit code 2)")]
    assert node.phase == NodePhase.FAILED and node.message == "retryStrategy.expression evaluated to false"
    # 5 s after the first, 15 s after the second: Argo waits out the backoff before it looks at the expression
    assert node.messages == ["Backoff for 5 seconds", "Backoff for 15 seconds", node.message]
    assert 4 < clock.waits[0] <= 5 and 14 < clock.waits[1] <= 15
    stored = cluster.server.get("workflows", cluster.namespace, "wf-flaky")["status"]["nodes"]
    assert {n["name"]: n["phase"] for n in stored.values()} == {"wf-flaky.step": "Failed", "wf-flaky.step(0)": "Failed",
                                                                "wf-flaky.step(1)": "Failed"}

    outputs = {"parameters": [{"name": "answer", "valueFrom": {"path": "/tmp/answer"}}]}
    fixed = controller.run_step(controller.submit(template("second", "test {{retries}} -ge 1 || exit 7; echo ok > /tmp/answer", outputs,
                                                           {"limit": 1}), "wf-second", {}), "step")
    assert fixed.phase == NodePhase.SUCCEEDED and [a.exit_code for a in fixed.attempts] == ["7", "0"]
    assert fixed.outputs["parameters"][0]["value"] == "ok"  # the step's outputs are its last attempt's


def test_a_deleted_pod_is_an_error_and_a_step_without_the_executors_rights_fails(cluster):
    controller = WorkflowController(cluster)

    def delete(index: int, pod: str) -> None:  # `kubectl delete pod --grace-period=0` while it runs
        while cluster.core().read_namespaced_pod(pod, cluster.namespace).status.phase != "Running":
            time.sleep(0.05)
        cluster.core().delete_namespaced_pod(pod, cluster.namespace, grace_period_seconds=0)
    node = controller.run_step(controller.submit(template("gone", "sleep 60", None, {"limit": 3}), "wf-gone", {}), "step",
                               on_attempt=delete)
    assert node.phase == NodePhase.ERROR and node.message == "pod deleted" and len(node.attempts) == 1  # OnFailure: not retried

    doc = template("norights", "true")
    doc["spec"]["serviceAccountName"] = "default"  # bound to no Role: the executor cannot report
    node = controller.run_step(controller.submit(doc, "wf-norights", {}), "step")
    log = wait_log(cluster, node.attempts[0].pod)
    assert node.phase == NodePhase.ERROR and node.message == "wait: Error (exit code 1)", log
    assert "see https://argo-workflows.readthedocs.io/en/latest/workflow-rbac/" in log
    assert f'cannot create resource "workflowtaskresults" in API group "argoproj.io"' in log, log
    assert cluster.refused(f"system:serviceaccount:{cluster.namespace}:default") == {
        ("create", "workflowtaskresults", cluster.namespace), ("patch", "workflowtaskresults", cluster.namespace)}


def test_in_a_restricted_namespace_argos_own_containers_are_let_in_only_with_deploy_argos_executor_settings(cluster):
    """A namespace enforcing PodSecurity `restricted`: the workflow hardens its pod and its main
    container, but Argo gives `init` and `wait` only the controller's `executor` settings, so the
    step pod is refused (the node's Error, in the API server's words) until the controller's
    ConfigMap is patched with deploy/argo/controller/executor-patch.yaml as its comment says."""
    api, ns = cluster.core(), cluster.namespace
    api.patch_namespace(ns, {"metadata": {"labels": {ENFORCE: "restricted"}}})
    api.create_namespaced_config_map("argo", k8s.V1ConfigMap(metadata=k8s.V1ObjectMeta(name="workflow-controller-configmap"),
                                                             data={"parallelism": "10"}))  # an installed controller's own
    controller = WorkflowController(cluster)
    outputs = {"parameters": [{"name": "answer", "valueFrom": {"path": "/tmp/answer"}}]}
    doc = template("restricted", "echo ok > /tmp/answer", outputs,
                   securityContext={"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}})
    doc["spec"]["templates"][1]["container"]["securityContext"] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    refused = controller.run_step(controller.submit(doc, "wf-psa-1", {}), "step")
    assert refused.phase == NodePhase.ERROR and refused.attempts == [], refused
    assert refused.message.endswith('violates PodSecurity "restricted:latest": allowPrivilegeEscalation != false (containers "init", '
                                    '"wait" must set securityContext.allowPrivilegeEscalation=false), unrestricted capabilities '
                                    '(containers "init", "wait" must set securityContext.capabilities.drop=["ALL"])'), refused.message

    with open(EXECUTOR_PATCH) as f:
        patch = yaml.safe_load(f)
    assert yaml.safe_load(patch["data"]["executor"]) == {"securityContext": EXECUTOR_SECURITY_CONTEXT}  # the README's, one source
    api.patch_namespaced_config_map("workflow-controller-configmap", "argo", patch)  # `kubectl patch --type merge`
    assert api.read_namespaced_config_map("workflow-controller-configmap", "argo").data["parallelism"] == "10"  # kept
    node = controller.run_step(controller.submit(doc, "wf-psa-2", {}), "step")
    pod_name = node.attempts[0].pod
    assert node.phase == NodePhase.SUCCEEDED, (node, wait_log(cluster, pod_name))
    assert node.outputs["parameters"][0]["value"] == "ok"  # wait ran, as the hardened container it now is
    pod = cluster.server.get("pods", ns, pod_name)
    assert {c["name"]: c.get("securityContext") for c in pod["spec"]["initContainers"] + pod["spec"]["containers"]
            if c["name"] != "main"} == {"init": EXECUTOR_SECURITY_CONTEXT, "wait": EXECUTOR_SECURITY_CONTEXT}
