"""Every manifest the backend makes and every file under deploy/ validates against a current
Kubernetes version's schema (kubernetes-validate, strict: no unknown fields); bad options are
refused with the option's name before anything starts."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml

from conftest import cli
from kfp_example import compiled_example

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPLOY = os.path.join(ROOT, "deploy")
K8S_VERSION = kubernetes_validate.utils.latest_version()
FULL_OPTIONS = ["--worker-cpu", "500m:2", "--worker-memory", "2Gi:4Gi", "--worker-gpus", "1", "--node-selector", "pool=gpu",
                "--toleration", "nvidia.com/gpu:NoSchedule", "--toleration", "spot=true", "--priority-class", "training",
                "--image-pull-secret", "regcred", "--service-account", "training-workers", "--image", "reg.example/es:1"]
IN_POD = {"ELASTIC_STEP_POD_NAME": "step-pod", "ELASTIC_STEP_POD_UID": "0b8e-uid", "ELASTIC_STEP_POD_IP": "10.4.0.7",
          "ELASTIC_STEP_POD_NAMESPACE": "ml"}


def validate(obj: dict) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def dry_run(tmp_path, *options, env=None) -> subprocess.CompletedProcess:
    return cli("train", "--backend", "kubernetes", "--dry-run", "--model-def", "m", "--data", "d",
               "--job-dir", str(tmp_path / "My_Job"), "--workers", "2:3", *options,
               env={**os.environ, **(env or {})})


def test_dry_run_prints_a_secret_a_network_policy_and_a_pod_per_slot_that_validate(tmp_path):
    done = dry_run(tmp_path, *FULL_OPTIONS, env=IN_POD)
    assert done.returncode == 0, done.stderr
    objects = list(yaml.safe_load_all(done.stdout))
    assert [o["kind"] for o in objects] == ["Secret", "NetworkPolicy", "Pod", "Pod", "Pod"]
    for obj in objects:
        validate(obj)
        assert obj["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "Pod", "name": "step-pod", "uid": "0b8e-uid"}]
    pod = objects[4]
    labels = pod["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "elastic-step" and labels["app.kubernetes.io/component"] == "worker"
    assert labels["elastic-step/job"] == "my-job" and labels["elastic-step/replica-index"] == "2"
    assert labels["sidecar.istio.io/inject"] == "false"  # no Envoy sidecar in a Kubeflow profile namespace
    spec, container = pod["spec"], pod["spec"]["containers"][0]
    assert spec["restartPolicy"] == "Never" and container["command"] == ["elastic-step", "worker"]
    assert container["image"] == "reg.example/es:1"
    assert container["resources"] == {"limits": {"cpu": "2", "memory": "4Gi", "nvidia.com/gpu": "1"},
                                      "requests": {"cpu": "500m", "memory": "2Gi"}}
    env_vars = {e["name"]: e["value"] for e in container["env"]}
    assert env_vars["ELASTIC_STEP_MASTER_URL"].startswith("http://10.4.0.7:")  # the master pod's IP
    assert env_vars["ELASTIC_STEP_COLLECTIVE_BACKEND"] == "nccl"
    assert env_vars["ELASTIC_STEP_TOKEN_FILE"].startswith(container["volumeMounts"][0]["mountPath"])
    assert spec["volumes"][0]["secret"]["secretName"] == objects[0]["metadata"]["name"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["readOnlyRootFilesystem"] is True and spec["securityContext"]["runAsNonRoot"] is True
    assert spec["nodeSelector"] == {"pool": "gpu"} and spec["priorityClassName"] == "training"
    assert spec["tolerations"] == [{"effect": "NoSchedule", "key": "nvidia.com/gpu", "operator": "Exists"},
                                   {"key": "spot", "operator": "Equal", "value": "true"}]
    assert spec["imagePullSecrets"] == [{"name": "regcred"}] and spec["serviceAccountName"] == "training-workers"
    assert spec["automountServiceAccountToken"] is False


def test_workers_in_another_namespace_than_the_masters_have_no_owner_references(tmp_path):
    # An owner in another namespace reads as absent to the garbage collector: it would delete them.
    done = dry_run(tmp_path, "--namespace", "batch", env=IN_POD)
    assert done.returncode == 0, done.stderr
    objects = list(yaml.safe_load_all(done.stdout))
    assert objects and all("ownerReferences" not in o["metadata"] for o in objects)
    pod = objects[-1]
    assert pod["spec"]["serviceAccountName"] == "elastic-step-worker" and pod["spec"]["automountServiceAccountToken"] is False


def test_dry_run_defaults_validate_without_a_cluster(tmp_path):
    done = dry_run(tmp_path)
    assert done.returncode == 0, done.stderr
    objects = list(yaml.safe_load_all(done.stdout))
    for obj in objects:
        validate(obj)
    from elastic_step.images import default_image

    assert objects[-1]["spec"]["containers"][0]["image"] == default_image()
    assert "ownerReferences" not in objects[-1]["metadata"]  # not in a pod: nothing to own them


@pytest.mark.parametrize("option, value, words", [
    ("--worker-memory", "lots", ["--worker-memory", "'lots'", "quantity"]),
    ("--worker-cpu", "4:2", ["--worker-cpu", "larger than the limit"]),
    ("--toleration", "gpu:Sometimes", ["--toleration", "NoSchedule"]),
    ("--node-selector", "pool", ["--node-selector", "KEY=VALUE"]),
])
def test_bad_kubernetes_options_are_refused_with_the_option_named(tmp_path, option, value, words):
    done = dry_run(tmp_path, option, value)
    assert done.returncode == 2 and done.stdout == ""
    assert all(w in done.stderr for w in words), done.stderr


def test_dry_run_needs_the_kubernetes_backend(tmp_path):
    done = cli("train", "--dry-run", "--model-def", "m", "--data", "d", "--job-dir", str(tmp_path / "j"))
    assert done.returncode == 2 and "--backend kubernetes" in done.stderr


def test_a_master_outside_any_pod_on_loopback_is_refused_before_anything_starts(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_STEP_POD")}
    done = cli("train", "--backend", "kubernetes", "--model-def", "m", "--data", "d", "--job-dir", str(tmp_path / "j"), env=env)
    assert done.returncode == 2 and "ELASTIC_STEP_POD_IP" in done.stderr and "--host" in done.stderr
    assert not os.path.exists(tmp_path / "j")


def deploy_objects() -> list[tuple[str, dict]]:
    """Every object under deploy/: kustomize builds rendered with kubectl where it is installed
    (else each listed file read directly), and the example files."""
    found = []
    builds = sorted(os.path.dirname(p) for p in glob.glob(os.path.join(DEPLOY, "**", "kustomization.yaml"), recursive=True))
    kubectl = shutil.which("kubectl")
    listed = set()
    for build in builds:
        with open(os.path.join(build, "kustomization.yaml")) as f:
            kustomization = yaml.safe_load(f)
        listed.update(os.path.join(build, r) for r in kustomization.get("resources", []) if r.endswith(".yaml"))
        if kubectl:
            out = subprocess.run([kubectl, "kustomize", build], capture_output=True, text=True, check=True).stdout
            found += [(os.path.relpath(build, ROOT), o) for o in yaml.safe_load_all(out) if o]
    for path in sorted(glob.glob(os.path.join(DEPLOY, "**", "*.yaml"), recursive=True)):
        if path.endswith(("kustomization.yaml", MERGE_PATCH)) or (kubectl and path in listed):
            continue
        with open(path) as f:
            found += [(os.path.relpath(path, ROOT), o) for o in yaml.safe_load_all(f) if o]
    return found


# A file named *-patch.yaml is a merge patch of a ConfigMap the platform already has (e.g. Argo's
# controller ConfigMap, patched with `kubectl patch --type merge --patch-file`), not an object.
MERGE_PATCH = "-patch.yaml"


def test_every_merge_patch_under_deploy_makes_a_valid_configmap():
    patches = sorted(glob.glob(os.path.join(DEPLOY, "**", "*" + MERGE_PATCH), recursive=True))
    assert patches, "deploy/ ships the Argo controller's executor patch"
    for path in patches:
        with open(path) as f:
            patch = yaml.safe_load(f)
        assert set(patch) == {"data"}, f"{path}: a merge patch here sets a ConfigMap's data only"
        validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "patched"}, **patch})


def test_every_file_under_deploy_validates():
    objects = deploy_objects()
    kinds = sorted({o["kind"] for _, o in objects})
    assert {"ServiceAccount", "Role", "RoleBinding", "Deployment", "Service", "PersistentVolumeClaim", "Workflow"} <= set(kinds)
    for where, obj in objects:
        if obj["apiVersion"].startswith("argoproj.io/"):
            # Argo's CRDs are not in the Kubernetes schema: Hera's models of them are.
            from hera.workflows.models import Workflow

            Workflow.model_validate(obj)
            continue
        try:
            validate(obj)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{where}: {obj['kind']} {obj['metadata'].get('name')}: {exc}") from None


def test_the_role_is_namespaced_and_grants_only_what_the_master_does():
    # What the backend calls: read its own pod; create, list, watch, delete worker pods; create and
    # delete the token Secret and the NetworkPolicies; create, update and delete the job's status
    # ConfigMap. No reads of Secrets, ConfigMaps or logs.
    role = next(o for _, o in deploy_objects() if o["kind"] == "Role" and o["metadata"]["name"] == "elastic-step-master")
    grants = {(tuple(r["apiGroups"]), tuple(r["resources"]), tuple(sorted(r["verbs"]))) for r in role["rules"]}
    assert grants == {(("",), ("pods",), ("create", "delete", "get", "list", "watch")),
                      (("",), ("secrets",), ("create", "delete")),
                      (("",), ("configmaps",), ("create", "delete", "patch")),
                      (("networking.k8s.io",), ("networkpolicies",), ("create", "delete"))}
    assert not [o for _, o in deploy_objects() if o["kind"].startswith("Cluster")]
    # Argo's executor gets only what it reports outputs with, in a Role of its own.
    executor = next(o for _, o in deploy_objects() if o["kind"] == "Role" and o["metadata"]["name"] == "elastic-step-argo-executor")
    assert [(r["apiGroups"], r["resources"], sorted(r["verbs"])) for r in executor["rules"]] == [
        (["argoproj.io"], ["workflowtaskresults"], ["create", "patch"])]


def test_workers_have_their_own_service_account_with_no_rbac_and_no_token():
    objects = [o for _, o in deploy_objects()]
    worker = next(o for o in objects if o["kind"] == "ServiceAccount" and o["metadata"]["name"] == "elastic-step-worker")
    assert worker["automountServiceAccountToken"] is False
    bound = {s["name"] for o in objects if o["kind"] == "RoleBinding" for s in o["subjects"]}
    assert "elastic-step-worker" not in bound
    from elastic_step.backends.kubernetes.options import WORKER_SERVICE_ACCOUNT

    assert WORKER_SERVICE_ACCOUNT == "elastic-step-worker"  # the backend's default is the shipped one
    with open(os.path.join(DEPLOY, "examples", "argo-workflow.yaml")) as f:
        example = yaml.safe_load(f)
    train = next(t for t in example["spec"]["templates"] if t["name"] == "train")["container"]["args"]
    assert "--service-account=elastic-step-worker" in train and "--service-account=elastic-step-runner" not in train


def test_mlflow_allows_its_service_name_and_postgres_comes_from_a_secret():
    objects = deploy_objects()
    container = next(o for w, o in objects if o["kind"] == "Deployment" and w == "deploy/mlflow")["spec"]["template"]["spec"]["containers"][0]
    allowed = next(a for a in container["args"] if a.startswith("--allowed-hosts="))
    assert "mlflow:5000" in allowed.split("=", 1)[1].split(",")
    postgres = next(o for w, o in objects if o["kind"] == "Deployment" and w.endswith("mlflow-postgres"))
    store = postgres["spec"]["template"]["spec"]["containers"][0]["env"][1]
    assert store["name"] == "MLFLOW_BACKEND_STORE_URI" and store["valueFrom"]["secretKeyRef"]["key"] == "uri"


def test_the_kfp_example_sets_the_masters_downward_api_env(tmp_path):
    text = yaml.safe_dump_all(compiled_example(tmp_path))
    for name in ("ELASTIC_STEP_POD_NAME", "ELASTIC_STEP_POD_UID", "ELASTIC_STEP_POD_IP", "status.podIP"):
        assert name in text


@pytest.mark.parametrize("pipeline", ["training_pipeline", "retraining_pipeline"])
def test_the_compiled_kfp_train_task_sets_the_masters_downward_api_env_and_store_keys(pipeline):
    with open(os.path.join(ROOT, "pipelines", "compiled", f"{pipeline}.yaml")) as f:
        documents = [d for d in yaml.safe_load_all(f) if d]
    executors = next(d for d in documents if "platforms" in d)["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    fields = {e["name"]: e["fieldPath"] for e in executors["exec-train-elastic"]["fieldPathAsEnv"]}
    assert fields == {"ELASTIC_STEP_POD_NAME": "metadata.name", "ELASTIC_STEP_POD_UID": "metadata.uid",
                      "ELASTIC_STEP_POD_NAMESPACE": "metadata.namespace", "ELASTIC_STEP_POD_IP": "status.podIP"}
    assert all(e["podMetadata"]["labels"]["app.kubernetes.io/part-of"] == "elastic-step" for e in executors.values())
    # The store's keys from KFP's own MinIO Secret, by reference, where it exists (optional)
    (secret,) = [s for s in executors["exec-train-elastic"]["secretAsEnv"] if s["secretName"] == "mlpipeline-minio-artifact"]
    assert secret["optional"] is True
    assert {k["secretKey"]: k["envVar"] for k in secret["keyToEnv"]} == {"accesskey": "AWS_ACCESS_KEY_ID",
                                                                         "secretkey": "AWS_SECRET_ACCESS_KEY"}


def test_a_master_with_a_pod_ip_listens_there_and_not_on_loopback(tmp_path, monkeypatch):
    # What the KFP component does: a TrainConfig with the default host, in a pod with the env above.
    from elastic_step.config import TrainConfig

    monkeypatch.setenv("ELASTIC_STEP_POD_IP", "10.4.0.7")
    config = TrainConfig(model_def="m", data="d", job_dir=str(tmp_path / "j"), backend="kubernetes")
    assert config.host == "10.4.0.7"


def test_the_backend_refuses_a_loopback_master_outside_a_pod(tmp_path):
    from elastic_step.backends.api import LaunchSpec
    from elastic_step.backends.kubernetes.backend import KubernetesBackend
    from elastic_step.backends.kubernetes.options import PodSettings
    from elastic_step.errors import ConfigError

    token = tmp_path / "token"
    token.write_text("t")
    with pytest.raises(ConfigError) as error:  # no API call is made: `api` would fail if one were
        KubernetesBackend(LaunchSpec("http://127.0.0.1:8080", str(token), str(tmp_path)), PodSettings(namespace="ml", image="i"),
                          "j", api=object(), master=None)
    assert "ELASTIC_STEP_POD_IP" in str(error.value) and "127.0.0.1" in str(error.value)


def test_mlflow_requires_authentication_with_credentials_only_from_a_secret():
    objects = deploy_objects()
    for where in ("deploy/mlflow", "deploy/mlflow-postgres"):
        deployment = next(o for w, o in objects if o["kind"] == "Deployment" and w == where)
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        command = container["command"] + container.get("args", [])
        assert command[command.index("--app-name") + 1] == "basic-auth"
        env = {e["name"]: e for e in container["env"]}
        for name, key in (("MLFLOW_AUTH_ADMIN_USERNAME", "admin-username"), ("MLFLOW_AUTH_ADMIN_PASSWORD", "admin-password"),
                          ("MLFLOW_FLASK_SERVER_SECRET_KEY", "flask-secret-key")):
            assert env[name]["valueFrom"]["secretKeyRef"] == {"name": "mlflow-auth", "key": key}
        assert "value" not in env["MLFLOW_AUTH_ADMIN_PASSWORD"]
    config = next(o for w, o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "mlflow-auth")
    ini = config["data"]["basic_auth.ini"]
    assert "admin_password" not in ini and "database_uri = sqlite:////mlflow/" in ini  # on the volume, not the image
    # No literal credential anywhere under deploy/.
    for where, obj in objects:
        for container in (obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])):
            for e in container.get("env", []):
                if any(word in e["name"] for word in ("PASSWORD", "SECRET", "TOKEN")):
                    assert "value" not in e, f"{where}: {e['name']} is a literal"


def test_mlflow_admits_only_step_pods_from_namespaces_that_run_jobs():
    objects = deploy_objects()
    policy = next(o for w, o in objects if o["kind"] == "NetworkPolicy" and w == "deploy/mlflow")
    mlflow = next(o for w, o in objects if o["kind"] == "Deployment" and w == "deploy/mlflow")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= mlflow["spec"]["template"]["metadata"]["labels"].items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    [rule] = policy["spec"]["ingress"]
    [peer] = rule["from"]  # one peer: both selectors must match (two peers would admit either)
    assert peer == {"namespaceSelector": {"matchLabels": {"elastic-step/jobs": "true"}},
                    "podSelector": {"matchLabels": {"elastic-step/mlflow-client": "true"}}}
    assert rule["ports"] == [{"protocol": "TCP", "port": 5000}]
    # Which pods carry the label is tested against the pods themselves: tests/test_security_deploy.py.
