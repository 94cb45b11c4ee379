"""deploy/rbac's ValidatingAdmissionPolicy against the cluster stand-in's admission (tests/cluster/
admission.py evaluates its CEL), as `kubectl apply -k deploy/` installs it.

The master imports the user's model code, so whatever elastic-step-runner's token may do, user code
may do. What a platform engineer relies on:
- a master's real requests pass: its token Secret, its NetworkPolicies, its worker pods, its status
  ConfigMap created and updated, and all of them deleted at the end;
- what user code could try with the token is refused with the policy's own message, as a 403:
  a pod that mounts MLflow's credentials or takes them as a variable, a pod of another service
  account or image, a patch of KFP's `kfp-launcher` or of the policy's own parameters, deleting
  MLflow's NetworkPolicy or Secret, a NetworkPolicy opening a job's pods to every namespace, a
  Secret minting a token of another service account;
- jobs in one namespace are out of each other's reach: a master pod's token may write only its own
  jobs' objects, so user code in one job cannot delete, rewrite or stop another's, nor pose as its worker;
- other users are not judged.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml
from kubernetes import client as k8s

from cluster import Cluster
from cluster.rbac import read_manifests
from elastic_step.backends.api import LaunchSpec
from elastic_step.backends.kubernetes.backend import KubernetesBackend
from elastic_step.backends.kubernetes.manifests import STOP_ANNOTATION
from elastic_step.backends.kubernetes.options import MasterPod, PodSettings

pytestmark = pytest.mark.e2e

POLICY = "elastic-step-runner-limits"


def shipped() -> list[dict]:
    """The policy and its binding, as deploy/rbac's kustomization lists them."""
    found = [o for o in read_manifests() if o["kind"].startswith("ValidatingAdmissionPolicy")]
    assert sorted(o["kind"] for o in found) == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    return found


def messages() -> list[str]:
    """The policy's messages, in its validations' order: the contract the refusals are held to."""
    policy = next(o for o in shipped() if o["kind"] == "ValidatingAdmissionPolicy")
    return [v["message"].strip() for v in policy["spec"]["validations"]]


CONFIGMAPS, SECRETS, NETWORK_POLICIES, POD_NAMES, POD_ACCOUNT, POD_IMAGE, POD_SECRETS, OWN_JOBS = range(8)


def install_policy(cluster: Cluster) -> None:
    """What `kubectl apply -k deploy/` adds beside the RBAC: the policy and its binding."""
    admin = k8s.AdmissionregistrationV1Api(k8s.ApiClient(cluster.configuration()))
    for obj in shipped():
        if obj["kind"] == "ValidatingAdmissionPolicy":
            admin.create_validating_admission_policy(obj)
        else:
            admin.create_validating_admission_policy_binding(obj)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(str(tmp_path_factory.mktemp("cluster"))) as c:
        install_policy(c)
        yield c


def refused(call, *args) -> str:
    with pytest.raises(k8s.ApiException) as caught:
        call(*args)
    assert caught.value.status == 403, caught.value.body
    return yaml.safe_load(caught.value.body)["message"]


def denial(resource: str, name: str, which: int) -> str:
    return (f'{resource} "{name}" is forbidden: ValidatingAdmissionPolicy \'{POLICY}\' with binding \'{POLICY}\' '
            f"denied request: {messages()[which]}")


def worker_like(cluster: Cluster, name: str, instance: str = "job-abc123", **changes) -> dict:
    """A pod shaped as a job's worker pod, for user code to vary one thing of."""
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": f"{instance}-{name}", "labels": {
               "app.kubernetes.io/managed-by": "elastic-step", "app.kubernetes.io/instance": instance,
               "app.kubernetes.io/component": "worker"}},
           "spec": {"serviceAccountName": "elastic-step-worker", "automountServiceAccountToken": False,
                    "restartPolicy": "Never",
                    "containers": [{"name": "worker", "image": cluster.project_image, "command": ["python", "-c", "pass"]}]}}
    for path, value in changes.items():
        *parents, last = path.split(".")
        node = pod
        for part in parents:
            node = node[part]
        node[last] = value
    return pod


def runner_backend(cluster: Cluster, tmp_path, monkeypatch, job: str, settings: PodSettings, master: MasterPod,
                   token: str) -> KubernetesBackend:
    """The master's Kubernetes backend as it starts in a step pod of elastic-step-runner, with that pod's token."""
    for name in ("KUBECONFIG", "ELASTIC_STEP_IMAGE", "ELASTIC_STEP_POD_NAME", "KFP_POD_NAME"):
        monkeypatch.delenv(name, raising=False)
    os.makedirs(tmp_path, exist_ok=True)
    job_token = tmp_path / "job-token"
    job_token.write_text("job-token-value")
    return KubernetesBackend(LaunchSpec("http://127.0.0.1:9", str(job_token), str(tmp_path)), settings, job, master=master,
                             api=cluster.core(token), watch_timeout_s=1)


def master_pod(cluster: Cluster, name: str) -> tuple[MasterPod, str]:
    """A step pod of elastic-step-runner and its token, bound to it as the kubelet's is."""
    ns = cluster.namespace
    pod = cluster.core().create_namespaced_pod(ns, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name}},
        "spec": {"serviceAccountName": cluster.service_account, "restartPolicy": "Never",
                 "containers": [{"name": "main", "image": cluster.project_image,
                                 "command": ["python", "-c", "import time; time.sleep(600)"]}]}})
    bound = k8s.V1BoundObjectReference(api_version="v1", kind="Pod", name=name, uid=pod.metadata.uid)
    request = k8s.AuthenticationV1TokenRequest(spec=k8s.V1TokenRequestSpec(audiences=[], bound_object_ref=bound))
    token = cluster.core().create_namespaced_service_account_token(cluster.service_account, ns, request).status.token
    return MasterPod(name=name, uid=pod.metadata.uid, ip="127.0.0.1", namespace=ns), token


def exits_until(backend: KubernetesBackend, timeout_s: float = 60) -> list:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        exits = backend.poll()
        if exits:
            return exits
        time.sleep(0.1)
    raise AssertionError("no worker exit reported")


def test_a_masters_own_requests_pass_the_policy_and_another_jobs_objects_are_out_of_its_reach(cluster, tmp_path,
                                                                                                  monkeypatch):
    """Two jobs in one namespace, each master with its own pod's token: each master's own requests
    pass; what user code in one could do to the other (delete its worker, rewrite its status, stop
    it, drop its NetworkPolicy or token, label a pod as its worker to mount its token) is refused.
    Job B's image is one the policy does not allow (ELASTIC_STEP_IMAGE of another registry, say):
    its master reports each refused worker as an exit that counts, saying why as the server did."""
    ns, core = cluster.namespace, cluster.core()
    (pod_a, token_a), (pod_b, token_b) = master_pod(cluster, "train-step-a"), master_pod(cluster, "train-step-b")
    settings = {"a": PodSettings(namespace=ns, image=None), "b": PodSettings(namespace=ns, image="registry.example/team/trainer:1")}
    with ThreadPoolExecutor(2) as pool:  # two masters start at once, as two jobs' steps do
        backend, other = pool.map(lambda a: runner_backend(cluster, tmp_path / a[0], monkeypatch, "admitted", settings[a[0]], *a[1]),
                                  (("a", (pod_a, token_a)), ("b", (pod_b, token_b))))
    names, theirs = backend.names, other.names
    assert names.instance.endswith("-" + pod_a.uid[:6]) and theirs.instance.endswith("-" + pod_b.uid[:6])
    assert sorted(backend.network_policies) == sorted([f"{names.instance}-workers", f"{names.instance}-master"])
    backend.launch(0, "w0.0")
    # Job B's worker, made with B's token as its master makes it (a light command: only its pod matters here).
    worker_b = theirs.pod("w0.0")
    cluster.core(token_b).create_namespaced_pod(ns, worker_like(cluster, "w0-0", instance=theirs.instance, **{
        "metadata.ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": pod_b.name, "uid": pod_b.uid}]}))
    deadline = time.monotonic() + 60
    while cluster.server.get("pods", ns, names.pod("w0.0")) is None and not backend._pending_failures:
        assert time.monotonic() < deadline, "the worker pod was never made"
        time.sleep(0.1)
    assert backend.poll() == []  # no create refused
    assert backend.publish({"job": "admitted", "state": "running"}) == {}  # created
    assert backend.publish({"job": "admitted", "state": "running", "step": 1}) == {}  # patched
    assert other.publish({"job": "admitted", "state": "running"}) == {}
    assert "step" in cluster.server.get("configmaps", ns, names.status_map)["data"]["status.json"]

    # User code in job A's master, with A's token, against job B.
    runner, runner_net = cluster.core(token_a), cluster.networking(token_a)
    assert refused(runner.delete_namespaced_pod, worker_b, ns) == denial("pods", worker_b, OWN_JOBS)
    assert refused(runner.patch_namespaced_config_map, theirs.status_map, ns,
                   {"metadata": {"annotations": {STOP_ANNOTATION: "now"}}}) == denial("configmaps", theirs.status_map, OWN_JOBS)
    assert refused(runner.delete_namespaced_config_map, theirs.status_map, ns) == denial("configmaps", theirs.status_map, OWN_JOBS)
    assert refused(runner.delete_namespaced_secret, theirs.secret, ns) == denial("secrets", theirs.secret, OWN_JOBS)
    policy = theirs.network_policy("master")
    assert refused(runner_net.delete_namespaced_network_policy, policy, ns) == \
        denial("networkpolicies.networking.k8s.io", policy, OWN_JOBS)
    # A pod labelled as B's worker, owned by A's master pod, mounting B's token Secret.
    posing = worker_like(cluster, "posing", instance=theirs.instance, **{
        "metadata.ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": pod_a.name, "uid": pod_a.uid}],
        "spec.volumes": [{"name": "token", "secret": {"secretName": theirs.secret}}]})
    assert refused(runner.create_namespaced_pod, ns, posing) == denial("pods", posing["metadata"]["name"], OWN_JOBS)
    assert cluster.server.get("pods", ns, worker_b) is not None

    other.launch(0, "w1.0")
    [gone] = exits_until(other)
    assert gone.worker_id == "w1.0" and gone.relaunch == "count"
    assert f"403 Forbidden: {denial('pods', theirs.pod('w1.0'), POD_IMAGE)}" in gone.reason, gone.reason

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda b: b.shutdown(grace_s=0), (backend, other)))
    left = [f"{p}/{o['metadata']['name']}" for p in ("pods", "secrets", "configmaps", "networkpolicies")
            for o in cluster.objects(p, ns)
            if (o["metadata"].get("labels") or {}).get("app.kubernetes.io/instance") in (names.instance, theirs.instance)]
    assert left == []
    for pod in (pod_a, pod_b):
        core.delete_namespaced_pod(pod.name, ns, grace_period_seconds=0)


def test_what_user_code_could_do_with_the_runners_token_is_refused_with_the_policys_message(cluster):
    ns, admin = cluster.namespace, cluster.core()
    runner = cluster.core(cluster.token_for(ns, cluster.service_account))
    runner_net = cluster.networking(cluster.token_for(ns, cluster.service_account))
    # What the namespace holds beside the jobs: MLflow's credentials for the steps, KFP's launcher
    # settings, and (an install from before the namespace split) MLflow's NetworkPolicy.
    admin.create_namespaced_secret(ns, {"metadata": {"name": "mlflow-credentials"}, "stringData": {"password": "not-real"}})
    admin.create_namespaced_config_map(ns, {"metadata": {"name": "kfp-launcher"}, "data": {"defaultPipelineRoot": "s3://a/b"}})
    cluster.networking().create_namespaced_network_policy(ns, {
        "metadata": {"name": "mlflow"}, "spec": {"podSelector": {"matchLabels": {"app": "mlflow"}}, "policyTypes": ["Ingress"]}})

    # Pods: MLflow's Secret mounted, or as a variable; another service account; another image.
    mounted = worker_like(cluster, "mount", **{"spec.volumes": [{"name": "m", "secret": {"secretName": "mlflow-credentials"}}]})
    assert refused(runner.create_namespaced_pod, ns, mounted) == denial("pods", "job-abc123-mount", POD_SECRETS)
    as_env = worker_like(cluster, "env")
    as_env["spec"]["containers"][0]["env"] = [{"name": "AWS_SECRET_ACCESS_KEY", "valueFrom": {
        "secretKeyRef": {"name": "mlflow-credentials", "key": "password"}}}]
    assert refused(runner.create_namespaced_pod, ns, as_env) == denial("pods", "job-abc123-env", POD_SECRETS)
    as_runner = worker_like(cluster, "sa", **{"spec.serviceAccountName": cluster.service_account})
    assert refused(runner.create_namespaced_pod, ns, as_runner) == denial("pods", "job-abc123-sa", POD_ACCOUNT)
    with_token = worker_like(cluster, "automount", **{"spec.automountServiceAccountToken": True})
    assert refused(runner.create_namespaced_pod, ns, with_token) == denial("pods", "job-abc123-automount", POD_ACCOUNT)
    other_image = worker_like(cluster, "image")
    other_image["spec"]["containers"][0]["image"] = "registry.example/miner:1"
    assert refused(runner.create_namespaced_pod, ns, other_image) == denial("pods", "job-abc123-image", POD_IMAGE)
    unlabelled = worker_like(cluster, "plain", **{"metadata.labels": {"app": "mine"}})
    assert refused(runner.create_namespaced_pod, ns, unlabelled) == denial("pods", "job-abc123-plain", POD_NAMES)
    # The store's keys from a Secret the parameters name pass, as a worker's do.
    store = worker_like(cluster, "store")
    store["spec"]["containers"][0]["env"] = [{"name": "AWS_ACCESS_KEY_ID", "valueFrom": {
        "secretKeyRef": {"name": "elastic-step-data-reader", "key": "AWS_ACCESS_KEY_ID"}}}]
    runner.create_namespaced_pod(ns, store)
    runner.delete_namespaced_pod("job-abc123-store", ns, grace_period_seconds=0)
    # Another pod of the namespace (MLflow's, another user's) deleted.
    admin.create_namespaced_pod(ns, {"metadata": {"name": "mlflow-0", "labels": {"app": "mlflow"}}, "spec": {
        "restartPolicy": "Never", "containers": [{"name": "main", "image": cluster.project_image, "command": ["python", "-c", "pass"]}]}})
    assert refused(runner.delete_namespaced_pod, "mlflow-0", ns) == denial("pods", "mlflow-0", POD_NAMES)

    # ConfigMaps: KFP's launcher settings changed or deleted, or one made in their place.
    assert refused(runner.patch_namespaced_config_map, "kfp-launcher", ns, {"data": {"defaultPipelineRoot": "s3://evil/x"}}) == \
        denial("configmaps", "kfp-launcher", CONFIGMAPS)
    assert refused(runner.delete_namespaced_config_map, "kfp-launcher", ns) == denial("configmaps", "kfp-launcher", CONFIGMAPS)
    assert refused(runner.create_namespaced_config_map, ns, {"metadata": {"name": "kfp-launcher-2"}}) == \
        denial("configmaps", "kfp-launcher-2", CONFIGMAPS)

    # NetworkPolicies: MLflow's deleted; one labelled as a job's that admits every namespace.
    assert refused(runner_net.delete_namespaced_network_policy, "mlflow", ns) == \
        denial("networkpolicies.networking.k8s.io", "mlflow", NETWORK_POLICIES)
    labels = {"app.kubernetes.io/managed-by": "elastic-step", "app.kubernetes.io/instance": "job-abc123",
              "app.kubernetes.io/component": "network-policy"}
    opened = {"metadata": {"name": "job-abc123-workers", "labels": labels}, "spec": {
        "podSelector": {"matchLabels": {"app.kubernetes.io/instance": "job-abc123"}}, "policyTypes": ["Ingress"],
        "ingress": [{"from": [{"namespaceSelector": {}}]}]}}
    assert refused(runner_net.create_namespaced_network_policy, ns, opened) == \
        denial("networkpolicies.networking.k8s.io", "job-abc123-workers", NETWORK_POLICIES)

    # Secrets: MLflow's deleted; a token of the runner minted through a service-account-token Secret.
    assert refused(runner.delete_namespaced_secret, "mlflow-credentials", ns) == denial("secrets", "mlflow-credentials", SECRETS)
    mint = {"metadata": {"name": "job-abc123-token", "annotations": {"kubernetes.io/service-account.name": "elastic-step-runner"},
                         "labels": {**labels, "app.kubernetes.io/component": "token"}},
            "type": "kubernetes.io/service-account-token"}
    assert refused(runner.create_namespaced_secret, ns, mint) == denial("secrets", "job-abc123-token", SECRETS)

    # Nothing of it happened; the admin, whom the policy does not judge, still changes what it likes.
    assert cluster.server.get("configmaps", ns, "kfp-launcher")["data"] == {"defaultPipelineRoot": "s3://a/b"}
    assert cluster.server.get("networkpolicies", ns, "mlflow") is not None
    admin.patch_namespaced_config_map("kfp-launcher", ns, {"data": {"defaultPipelineRoot": "s3://a/c"}})
    admin.delete_namespaced_pod("mlflow-0", ns, grace_period_seconds=0)
