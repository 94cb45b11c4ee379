"""What deploy/ lets the people and pods of a cluster do to MLflow, as `kubectl apply -k` creates it.

- MLflow lives in a namespace of its own. A person bound to deploy/operator's Role (which patches
  the jobs' status ConfigMaps) and a job's master (deploy/rbac's runner, which creates pods and
  Secrets and deletes NetworkPolicies) cannot patch MLflow's auth settings (`mlflow-auth`, where
  `default_permission = MANAGE` would make every user an admin at the next restart), delete its
  NetworkPolicy, or mount its Secret into a pod. Asked of the cluster stand-in's API server, whose
  RBAC evaluates the Roles and bindings as kustomize builds them (`kubectl kustomize`, the client
  the cluster tests use).
- MLflow's NetworkPolicy admits the pods that call MLflow and no others: the step pods of the
  Argo templates, the compiled KFP pipelines, `elastic-step submit` and the examples, in a
  namespace that runs jobs; never a worker pod (the backend's labels), never a pod of another
  namespace. Judged on the label sets those pods really carry, with the selector semantics of
  NetworkPolicy (a peer with both selectors: the pod's namespace AND the pod must match;
  matchLabels: every pair present)."""

from __future__ import annotations

import os
import shutil
import subprocess

import yaml
from kubernetes import client as k8s

from cluster import Cluster
from cluster.rbac import REPO
from elastic_step.backends.kubernetes.manifests import JobNames, worker_pod
from elastic_step.backends.kubernetes.options import MasterPod, PodSettings
from kfp_example import compiled_example

DEPLOY = os.path.join(REPO, "deploy")
KUBECTL = shutil.which("kubectl") or "kubectl"  # on the machine image: the real client the cluster tests use


def built(folder: str) -> list[dict]:
    """The objects `kubectl apply -k FOLDER` creates, each with its namespace."""
    out = subprocess.run([KUBECTL, "kustomize", os.path.join(DEPLOY, folder)], capture_output=True, text=True,
                         check=True).stdout
    return [o for o in yaml.safe_load_all(out) if o]


def one(objects: list[dict], kind: str, name: str) -> dict:
    [found] = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


# -- item: an operator (or a master) can make every MLflow user an admin --------------------------

def test_neither_an_operator_nor_a_master_can_touch_mlflows_auth_settings_or_its_policy(tmp_path):
    jobs = built(".")
    # docs/kubernetes.md's second apply, unless deploy/ itself already holds MLflow.
    mlflow = [] if any(o["metadata"]["name"] == "mlflow-auth" for o in jobs) else built("mlflow")
    operator_role = one(jobs, "Role", "elastic-step-operator")
    jobs_ns = operator_role["metadata"]["namespace"]
    auth, policy = one(jobs + mlflow, "ConfigMap", "mlflow-auth"), one(jobs + mlflow, "NetworkPolicy", "mlflow")
    mlflow_ns = auth["metadata"]["namespace"]
    with Cluster(str(tmp_path / "cluster"), namespace=jobs_ns) as cluster:
        admin = cluster.core()
        if mlflow_ns != jobs_ns:
            admin.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=mlflow_ns)))
        for obj in jobs + mlflow:  # every Role and binding as applied, in the namespace kustomize gives it
            if obj["kind"] in ("Role", "RoleBinding"):
                cluster.authorizer.apply(obj)
        admin.create_namespaced_config_map(mlflow_ns, {k: v for k, v in auth.items() if k != "status"})
        admin.create_namespaced_secret(mlflow_ns, k8s.V1Secret(metadata=k8s.V1ObjectMeta(name="mlflow-auth"),
                                                                string_data={"admin-password": "not-a-real-secret"}))
        cluster.networking().create_namespaced_network_policy(mlflow_ns, policy)
        status = admin.create_namespaced_config_map(jobs_ns, k8s.V1ConfigMap(
            metadata=k8s.V1ObjectMeta(name="digits-1a2b3c-status", labels={"app.kubernetes.io/component": "status"}),
            data={"status.json": "{}"}))
        # deploy/operator's Role bound to a person, as its own comment says to.
        cluster.authorizer.apply({"kind": "RoleBinding", "metadata": {"name": "alice-elastic-step", "namespace": jobs_ns},
                                  "roleRef": {"kind": "Role", "name": "elastic-step-operator"},
                                  "subjects": [{"kind": "User", "name": "alice"}]})
        alice = cluster.core(cluster.authorizer.issue_token("alice"))
        runner_token = cluster.token_for(jobs_ns, cluster.service_account)
        runner, runner_net = cluster.core(runner_token), cluster.networking(runner_token)

        # The operator still does its job: a stop request on a job's status ConfigMap.
        alice.patch_namespaced_config_map(status.metadata.name, jobs_ns,
                                          {"metadata": {"annotations": {"elastic-step/stop-requested": "now"}}})
        escalate = {"data": {"basic_auth.ini": auth["data"]["basic_auth.ini"].replace(
            "default_permission = READ", "default_permission = MANAGE")}}
        attempts = {
            "operator patches mlflow-auth": lambda: alice.patch_namespaced_config_map("mlflow-auth", mlflow_ns, escalate),
            "master patches mlflow-auth": lambda: runner.patch_namespaced_config_map("mlflow-auth", mlflow_ns, escalate),
            "master deletes mlflow-auth": lambda: runner.delete_namespaced_config_map("mlflow-auth", mlflow_ns),
            "master deletes MLflow's policy": lambda: runner_net.delete_namespaced_network_policy("mlflow", mlflow_ns),
            "master mounts MLflow's Secret": lambda: runner.create_namespaced_pod(mlflow_ns, k8s.V1Pod(
                metadata=k8s.V1ObjectMeta(name="exfiltrate"),
                spec=k8s.V1PodSpec(containers=[k8s.V1Container(name="main", image="busybox")], volumes=[
                    k8s.V1Volume(name="s", secret=k8s.V1SecretVolumeSource(secret_name="mlflow-auth"))]))),
        }
        allowed = []
        for what, attempt in attempts.items():
            try:
                attempt()
                allowed.append(what)
            except k8s.ApiException as exc:
                assert exc.status == 403, (what, exc.status, exc.body)
        assert allowed == [], f"MLflow's objects in namespace {mlflow_ns} are reachable: {allowed}"
        after = admin.read_namespaced_config_map("mlflow-auth", mlflow_ns).data["basic_auth.ini"]
        assert "default_permission = READ" in after
        assert admin.read_namespaced_config_map(status.metadata.name, jobs_ns).metadata.annotations == {
            "elastic-step/stop-requested": "now"}


# -- item: MLflow's NetworkPolicy admits step pods only, from namespaces that run jobs -------------

def selected(selector: dict, labels: dict) -> bool:
    """A LabelSelector of matchLabels only (the policy uses no expressions: asserted below)."""
    assert set(selector) <= {"matchLabels"}, selector
    return selector.get("matchLabels", {}).items() <= labels.items()


def admitted(policy: dict, namespace_labels: dict, pod_labels: dict) -> bool:
    """Whether an ingress rule's peer admits a pod (NetworkPolicy: a peer with both selectors
    needs both to match; a peer without a namespaceSelector means the policy's own namespace,
    which no step pod is in)."""
    for rule in policy["spec"]["ingress"]:
        for peer in rule.get("from") or []:
            assert "namespaceSelector" in peer and "podSelector" in peer, peer
            if selected(peer["namespaceSelector"], namespace_labels) and selected(peer["podSelector"], pod_labels):
                return True
    return False


def namespace_labels(namespace: dict) -> dict:
    """A Namespace's labels as the API server keeps them (it adds kubernetes.io/metadata.name)."""
    return {**(namespace["metadata"].get("labels") or {}), "kubernetes.io/metadata.name": namespace["metadata"]["name"]}


def step_pod_labels(capsys) -> dict[str, dict]:
    """The labels of every pod that calls MLflow, as the shipped files and commands make them."""
    found = {}
    for name in sorted(os.listdir(os.path.join(REPO, "pipelines", "argo"))):
        with open(os.path.join(REPO, "pipelines", "argo", name), encoding="utf-8") as f:
            document = yaml.safe_load(f)
        spec = document["spec"].get("workflowSpec", document["spec"])
        if "podMetadata" in spec or "templates" in spec:  # a Workflow that only refers to a template has none
            found[f"argo {name}"] = spec["podMetadata"]["labels"]
    for name in ("training_pipeline", "retraining_pipeline"):
        with open(os.path.join(REPO, "pipelines", "compiled", f"{name}.yaml"), encoding="utf-8") as f:
            platform = next(d for d in yaml.safe_load_all(f) if d and "platforms" in d)
        for executor, config in platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"].items():
            found[f"kfp {name} {executor}"] = config["podMetadata"]["labels"]
    with open(os.path.join(DEPLOY, "examples", "argo-workflow.yaml"), encoding="utf-8") as f:
        found["example argo-workflow.yaml"] = yaml.safe_load(f)["spec"]["podMetadata"]["labels"]
    from elastic_step.cli import main

    assert main(["submit", "--job-name", "digits-1", "--namespace", "ml", "--image", "img", "--model-def", "m",
                 "--data", "s3://b/digits", "--dry-run"]) == 0
    pods = [o for o in yaml.safe_load_all(capsys.readouterr().out) if o and o["kind"] == "Pod"]
    found["submit's master pod"] = pods[0]["metadata"]["labels"]
    return found


def kfp_example_labels(tmp_path) -> dict:
    """deploy/examples/kfp_master_env.py's task, compiled by KFP's own compiler."""
    platform = next(d for d in compiled_example(tmp_path) if "platforms" in d)
    [executor] = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"].values()
    return executor["podMetadata"]["labels"]


def test_mlflows_policy_admits_the_step_pods_of_every_shipped_pipeline_and_never_a_worker(tmp_path, capsys):
    policy = one(built("mlflow"), "NetworkPolicy", "mlflow")
    jobs = built(".")
    jobs_ns = one(jobs, "Role", "elastic-step-operator")["metadata"]["namespace"]
    shipped = [o for o in jobs if o["kind"] == "Namespace" and o["metadata"]["name"] == jobs_ns]
    jobs_namespace = namespace_labels(shipped[0] if shipped else {"metadata": {"name": jobs_ns}})
    steps = step_pod_labels(capsys)
    steps["example kfp_master_env.py"] = kfp_example_labels(tmp_path)
    assert len([s for s in steps if s.startswith("kfp ")]) >= 10 and len([s for s in steps if s.startswith("argo ")]) >= 2
    refused = [where for where, labels in steps.items() if not admitted(policy, jobs_namespace, labels)]
    assert refused == [], f"step pods MLflow's NetworkPolicy would refuse: {refused}"

    # Worker pods never call MLflow: the backend's labels, for a job started from any of them.
    names = JobNames.for_job("train-elastic")
    worker = worker_pod(PodSettings(namespace="ml", image="img"), names, MasterPod("step", "uid", "10.0.0.5", "ml"),
                        "img", "w0.1", 0, "http://10.0.0.5:8080")
    assert not admitted(policy, jobs_namespace, worker.metadata.labels)
    # A step pod in a namespace that runs no jobs (no label; the API server's own label only).
    any_step = next(iter(steps.values()))
    for other in ("default", "kube-system", "mlflow"):
        assert not admitted(policy, namespace_labels({"metadata": {"name": other}}), any_step)


# -- item: worker pods hold the keys to KFP's whole artifact store --------------------------------

def test_the_shipped_data_reader_policy_only_reads_one_prefix_of_one_bucket():
    """deploy/examples/data-reader-policy.json, the policy docs/kubernetes.md makes the default
    worker Secret's user with (S3's and MinIO's policy language): reads, nothing else."""
    import json

    with open(os.path.join(DEPLOY, "examples", "data-reader-policy.json"), encoding="utf-8") as f:
        policy = json.load(f)
    statements = policy["Statement"]
    assert all(s["Effect"] == "Allow" for s in statements)
    actions = {a for s in statements for a in s["Action"]}
    assert actions == {"s3:GetObject", "s3:ListBucket"}
    objects = [r for s in statements if "s3:GetObject" in s["Action"] for r in s["Resource"]]
    assert objects and all(r.count("/") >= 1 and r.endswith("/*") and "*" not in r[:-2] for r in objects), objects
    listing = next(s for s in statements if "s3:ListBucket" in s["Action"])
    assert listing["Condition"]["StringLike"]["s3:prefix"], "listing limited to the dataset's prefix"
    with open(os.path.join(REPO, "docs", "kubernetes.md"), encoding="utf-8") as f:
        docs = f.read()
    from elastic_step.backends.kubernetes.store_access import DEFAULT_WORKER_STORE_SECRET

    assert "data-reader-policy.json" in docs and f"create secret generic {DEFAULT_WORKER_STORE_SECRET}" in docs
