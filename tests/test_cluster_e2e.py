"""The elastic master as a pod of a cluster that shares nothing with it (tests/cluster): the
training step's pod is created through the API server stand-in; the kubelet runs it in its own
filesystem view, with only its spec's env (the downward API), its service account's token
mounted where a pod finds it, and the API reached over HTTPS by in-cluster config. The master
creates its worker pods through the API with that service account (deploy/'s Role, enforced);
workers read the prepared data from a private bucket of an S3 server, never from a folder of the
master's, with the credentials the master's own pod takes from a Secret.

The test acts as the cluster's operator: it reads the master's status through the master's own
scratch volume on the node (as `kubectl exec` would), SIGKILLs one worker's container (`docker
kill`), pauses another (`docker pause`), pushes a third over its memory limit (a real OOM kill
by the kernel), and checks what the job left behind and what it asked of the API."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
from kubernetes import client as k8s

from cluster import Cluster, Image, role_rules, venv_image
from cluster.masterpod import MasterPodOnNode
from conftest import SLOW_MODEL
from elastic_step.audit import audit_report
from stores import S3Server, upload

pytestmark = pytest.mark.e2e

TEST_IMAGE = "registry.example/ml/elastic-step-torch-test:0.1.0"  # the project's image plus slow_digits.py
OLD_RELEASE_IMAGE = "registry.example/ml/elastic-step-torch-test:0.0.9"
BUCKET = "training-data"
SCRATCH = "/tmp"  # the master pod's emptyDir
JOB_DIR = "/tmp/job"
STORE_SECRET = "training-data-store"


@pytest.fixture
def s3():
    with S3Server() as server:
        yield server.endpoint


@pytest.fixture
def cluster(tmp_path):
    layer = tmp_path / "image-layer"  # what a derived image adds: the user's model definition
    layer.mkdir()
    shutil.copy(SLOW_MODEL, layer / "slow_digits.py")
    image = venv_image(TEST_IMAGE, extra_path=[str(layer)])
    # The same derived image built on an earlier release: its installed distribution says 0.0.9.
    old_release = tmp_path / "old-release-layer"
    shutil.copytree(layer, old_release)
    (old_release / "elastic_step-0.0.9.dist-info").mkdir()
    (old_release / "elastic_step-0.0.9.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: elastic-step\nVersion: 0.0.9\n")
    images = {TEST_IMAGE: image, OLD_RELEASE_IMAGE: venv_image(OLD_RELEASE_IMAGE, extra_path=[str(old_release)])}
    with Cluster(str(tmp_path / "cluster"), images=images) as c:
        print(f"kubelet runtime: {c.kubelet.mode}")
        yield c


def master_pod(cluster: Cluster, name: str, args: list[str]) -> k8s.V1Pod:
    """The training step's pod as a workflow engine makes it: the step's container, the
    downward-API env the templates set, the master's service account, a scratch volume."""
    downward = lambda path: k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(field_path=path))  # noqa: E731
    secret_key = lambda key: k8s.V1EnvVarSource(secret_key_ref=k8s.V1SecretKeySelector(name=STORE_SECRET, key=key))  # noqa: E731
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(name=name, labels={"app.kubernetes.io/name": "train-step", "workflows.argoproj.io/workflow": "wf-1"}),
        spec=k8s.V1PodSpec(
            service_account_name=cluster.service_account,
            restart_policy="Never",
            security_context=k8s.V1PodSecurityContext(run_as_user=1000, run_as_group=1000, fs_group=1000),
            containers=[k8s.V1Container(
                name="main", image=TEST_IMAGE, command=["elastic-step", "train", *args],
                env=[k8s.V1EnvVar(name="ELASTIC_STEP_POD_NAME", value_from=downward("metadata.name")),
                     k8s.V1EnvVar(name="ELASTIC_STEP_POD_UID", value_from=downward("metadata.uid")),
                     k8s.V1EnvVar(name="ELASTIC_STEP_POD_NAMESPACE", value_from=downward("metadata.namespace")),
                     k8s.V1EnvVar(name="ELASTIC_STEP_POD_IP", value_from=downward("status.podIP")),
                     k8s.V1EnvVar(name="MLFLOW_TRACKING_URI", value=f"sqlite:///{SCRATCH}/mlflow.db"),
                     # The store's credentials, from a Secret: workers must be given the same references.
                     k8s.V1EnvVar(name="AWS_ACCESS_KEY_ID", value_from=secret_key("access-key")),
                     k8s.V1EnvVar(name="AWS_SECRET_ACCESS_KEY", value_from=secret_key("secret-key"))],
                volume_mounts=[k8s.V1VolumeMount(name="scratch", mount_path=SCRATCH)],
                resources=k8s.V1ResourceRequirements(limits={"memory": "3Gi"}, requests={"memory": "1Gi", "cpu": "500m"}),
            )],
            volumes=[k8s.V1Volume(name="scratch", empty_dir=k8s.V1EmptyDirVolumeSource())],
        ),
    )


def store_secret(api: k8s.CoreV1Api, namespace: str) -> None:
    """The Secret the master pod takes the store's keys from (by reference)."""
    api.create_namespaced_secret(namespace, k8s.V1Secret(metadata=k8s.V1ObjectMeta(name=STORE_SECRET),
                                                         string_data={"access-key": "AKIDTEST", "secret-key": "not-a-real-secret"}))


class MasterOnNode(MasterPodOnNode):
    """The master's job folder as the node has it (the pod's scratch volume)."""

    def __init__(self, cluster: Cluster, name: str, job_dir: str = JOB_DIR):
        super().__init__(cluster, name, job_dir)

    def path(self, pod_path: str) -> str:
        scratch = self.cluster.kubelet.volume_path(self.cluster.namespace, self.name, "scratch")
        return os.path.join(scratch, os.path.relpath(pod_path, SCRATCH))


def test_master_pod_trains_on_worker_pods_through_the_api_with_its_role_through_killed_hung_and_oom_killed_workers(tmp_path, digits, s3, cluster):
    train_through_failures(cluster, s3, digits)


@pytest.fixture(scope="module")
def docker_daemon():
    """A Docker daemon of the test's own, with the image `make image-smoke` builds (built first
    when its data root does not hold it, or holds one built from other sources)."""
    from cluster.runtime import DockerDaemon, image_smoke_dir

    daemon = DockerDaemon(image_smoke_dir()).start()
    yield daemon
    daemon.stop()


def test_the_same_job_with_every_pod_a_docker_container_of_the_built_image(tmp_path, digits, s3, docker_daemon):
    """The kubelet's Docker runtime: each container is `docker run --network host` of the image
    `make image-smoke` built (the model definition bind-mounted beside it, as a derived image
    would add it); SIGKILL is `docker kill`, a hang `docker pause`, the OOM kill Docker's."""
    from elastic_step.images import default_image

    layer = tmp_path / "image-layer"
    layer.mkdir()
    shutil.copy(SLOW_MODEL, layer / "slow_digits.py")
    os.chmod(layer, 0o755)
    image = Image(TEST_IMAGE, {"PYTHONPATH": "/image/layer0"}, layers={"/image/layer0": str(layer)}, docker=default_image())
    with Cluster(str(tmp_path / "cluster"), images={TEST_IMAGE: image}, docker=docker_daemon) as cluster:
        print(f"kubelet runtime: {cluster.kubelet.mode}")
        train_through_failures(cluster, s3, digits)


def train_through_failures(cluster, s3, digits):
    data = upload(s3, digits, BUCKET, "digits")
    epochs = 3
    args = ["--backend", "kubernetes", "--data", data, "--storage-option", f"endpoint_url={s3}",
            "--model-def", "slow_digits", "--job-dir", JOB_DIR, "--audit", f"{JOB_DIR}/audit.jsonl", "--workers", "2:4",
            "--epochs", str(epochs), "--minibatch-size", "16", "--minibatches-per-task", "2", "--heartbeat-timeout", "4",
            "--checkpoint-steps", "0", "--worker-cpu", "1", "--worker-memory", "1Gi", "--max-relaunches", "1", "--no-progress"]
    ns = cluster.namespace
    api = cluster.core()
    store_secret(api, ns)
    api.create_namespaced_pod(ns, master_pod(cluster, "train-step-7f9c", args))
    master = MasterOnNode(cluster, "train-step-7f9c")

    started = time.monotonic()
    status = master.wait(lambda s: s["state"] == "running" and s["world_size"] == 4
                         and 0.05 < s["rows_done"] / s["rows_total"] < 0.35, timeout=150)
    print(f"job running on 4 worker pods after {time.monotonic() - started:.1f}s")
    victim = next(w for w in status["workers"] if w["rank"] == 1)
    assert victim["pod"].startswith("job-") and cluster.kubelet.record(ns, victim["pod"])
    cluster.kubelet.kill(ns, victim["pod"])  # docker kill: the container dies with SIGKILL
    killed_at, rows_at_kill = time.monotonic(), status["rows_done"]

    # Once the survivors train again, two more of the first workers fail, while a third (which
    # holds the model state) stays: one hangs (docker pause: its heartbeats stop, the master drops
    # it), one goes over its memory limit (the kernel kills it, the kubelet says OOMKilled).
    status = master.wait(lambda s: victim["id"] not in [w["id"] for w in s["workers"] if w["state"] == "live"]
                         and s["rows_done"] > rows_at_kill)
    print(f"training again {time.monotonic() - killed_at:.1f}s after the SIGKILL")
    first = [w for w in status["workers"] if w["state"] == "live" and w["id"].endswith(".1") and w["id"] != victim["id"] and w.get("pod")]
    assert len(first) == 3, status["workers"]
    hung, oom = first[0], first[1]
    cluster.kubelet.pause(ns, hung["pod"])
    cluster.kubelet.fill_memory(ns, oom["pod"], 1200)
    paused_at = time.monotonic()
    master.wait(lambda s: not {hung["id"], oom["id"]} & {w["id"] for w in s["workers"] if w["state"] == "live"})
    print(f"paused and OOM-killed workers gone after {time.monotonic() - paused_at:.1f}s")

    phase = master.wait_ended(150)
    log = master.log()
    assert phase == "Succeeded", log
    print(f"job done {time.monotonic() - started:.1f}s after it started")

    report = audit_report(master.path(f"{JOB_DIR}/audit.jsonl"), digits, epochs)
    assert report["exact"] and report["rows_applied"] == report["rows_expected"], report
    with open(master.path(f"{JOB_DIR}/result.json")) as f:
        result = json.load(f)
    assert result["test_metrics"]["accuracy"] >= 0.85, result["test_metrics"]
    with open(master.path(f"{JOB_DIR}/events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    died = {e["worker"]: e for e in events if e["event"] == "died"}
    assert set(died) == {victim["id"], hung["id"], oom["id"]}, died
    assert "OOMKilled" in died[oom["id"]]["reason"] and "1Gi" in died[oom["id"]]["reason"], died
    assert any(e["event"] == "not_relaunched" and e["worker"] == oom["id"] for e in events)
    assert "137" in died[victim["id"]]["reason"] or "SIGKILL" in died[victim["id"]]["reason"], died
    assert any(e["event"] == "dropped" and e["worker"] == hung["id"] and "hung" in e.get("message", json.dumps(e)) for e in events)
    assert {e["worker"] for e in events if e["event"] == "relaunched"} == {victim["id"], hung["id"]}
    print("recoveries (s):", result["recoveries_s"])

    # What the worker pods were: the master's image, owned by the master pod, no API token.
    master_uid = api.read_namespaced_pod("train-step-7f9c", ns).metadata.uid
    workers = [e[4] for e in cluster.server.store.history
               if e[1] == "pods" and e[3] == "ADDED" and e[4]["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "worker"]
    assert len(workers) == 6, [w["metadata"]["name"] for w in workers]  # 4 and two replacements (none for the OOM)
    for pod in workers:
        assert pod["spec"]["containers"][0]["image"] == TEST_IMAGE
        assert [r["uid"] for r in pod["metadata"]["ownerReferences"]] == [master_uid]
        assert not any("kube-api-access" in v["name"] for v in pod["spec"].get("volumes", []))
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {"name": STORE_SECRET, "key": "secret-key"}

    # Nothing of the job is left: its pods, Secret and NetworkPolicies were deleted by the master itself.
    instance = workers[0]["metadata"]["labels"]["app.kubernetes.io/instance"]
    left = [o["metadata"]["name"] for plural in ("pods", "secrets", "networkpolicies") for o in cluster.objects(plural)
            if o["metadata"].get("labels", {}).get("app.kubernetes.io/instance") == instance]
    assert left == []

    # The verbs the job used are exactly the Role's: nothing refused, nothing granted in vain.
    assert cluster.refused() == set()
    used = cluster.used()
    assert {n for _, _, n in used} == {ns}
    assert {(verb, resource) for verb, resource, _ in used} == role_rules()


def test_a_master_whose_service_account_has_no_role_fails_saying_so_and_creates_nothing(tmp_path, digits, s3, cluster):
    """The step pod run as a service account without deploy/'s Role (here the namespace's
    `default`): the master's pre-flight asks the API server what it may do, and the job ends at
    once (exit 2) listing every missing right and naming the Role, before any call is refused;
    no pod is created."""
    data = upload(s3, digits, BUCKET, "digits")
    ns = cluster.namespace
    api = cluster.core()
    store_secret(api, ns)
    args = ["--backend", "kubernetes", "--data", data, "--storage-option", f"endpoint_url={s3}", "--model-def", "slow_digits",
            "--job-dir", JOB_DIR, "--workers", "2", "--epochs", "1", "--no-progress",
            "--image", TEST_IMAGE]
    pod = master_pod(cluster, "train-step-norole", args)
    pod.spec.service_account_name = "default"
    api.create_namespaced_pod(ns, pod)
    deadline = time.monotonic() + 120
    while api.read_namespaced_pod("train-step-norole", ns).status.phase not in ("Succeeded", "Failed") and time.monotonic() < deadline:
        time.sleep(0.2)
    log = api.read_namespaced_pod_log("train-step-norole", ns)
    assert api.read_namespaced_pod("train-step-norole", ns).status.phase == "Failed", log
    assert (f'error: the service account "default" of namespace {ns} may not create, delete, patch configmaps; '
            "create, delete, get, list, watch pods; create, delete secrets; create, delete networking.k8s.io/networkpolicies "
            f"in namespace {ns}") in log and "deploy/rbac" in log, log
    terminated = api.read_namespaced_pod("train-step-norole", ns).status.container_statuses[0].state.terminated
    assert terminated.exit_code == 2, log
    default_user = f"system:serviceaccount:{ns}:default"
    assert cluster.refused(default_user) == set() and cluster.used(default_user) == set(), cluster.server.audit
    assert [p["metadata"]["name"] for p in cluster.pods()] == ["train-step-norole"]
    assert [s["metadata"]["name"] for s in cluster.objects("secrets")] == [STORE_SECRET]  # no job token Secret


def test_worker_pods_that_cannot_read_the_data_fail_the_job_at_once_saying_what_to_fix(tmp_path, digits, s3, cluster):
    """The master's container holds the store's keys as literal values, which are never copied
    into another pod: the master reads the data, its workers cannot. Each worker's pre-flight
    says so to the master, which fails the job at once with that line, relaunching nothing."""
    data = upload(s3, digits, BUCKET, "digits")
    ns = cluster.namespace
    api = cluster.core()
    args = ["--backend", "kubernetes", "--data", data, "--storage-option", f"endpoint_url={s3}", "--model-def", "slow_digits",
            "--job-dir", JOB_DIR, "--workers", "2", "--epochs", "1", "--no-progress"]
    pod = master_pod(cluster, "train-step-literal", args)
    for var in pod.spec.containers[0].env:
        if var.name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            var.value, var.value_from = {"AWS_ACCESS_KEY_ID": "AKIDTEST", "AWS_SECRET_ACCESS_KEY": "not-a-real-secret"}[var.name], None
    api.create_namespaced_pod(ns, pod)
    master = MasterOnNode(cluster, "train-step-literal")
    phase = master.wait_ended(150)
    log = master.log()
    assert phase == "Failed", log
    failure = [line for line in log.splitlines() if "pre-flight" in line]
    assert failure and "cannot read the dataset's manifest s3://" in failure[0] and "secretKeyRef" in failure[0], log
    with open(master.path(f"{JOB_DIR}/events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    assert not [e for e in events if e["event"] == "relaunched"], events
    assert [o["metadata"]["name"] for o in cluster.pods()] == ["train-step-literal"]  # its worker pods are gone


def test_worker_pods_of_another_release_fail_the_job_at_registration_naming_both_releases(tmp_path, digits, s3, cluster):
    """`--image` names a worker image built on an earlier release than the master's: its
    workers would follow other rules in the same rounds. The first to register is refused, and
    the job fails at once with one line naming both engines; no slot is relaunched."""
    data = upload(s3, digits, BUCKET, "digits")
    ns = cluster.namespace
    store_secret(cluster.core(), ns)
    args = ["--backend", "kubernetes", "--image", OLD_RELEASE_IMAGE, "--data", data, "--storage-option", f"endpoint_url={s3}",
            "--model-def", "slow_digits", "--job-dir", JOB_DIR, "--workers", "2", "--epochs", "1", "--no-progress"]
    cluster.core().create_namespaced_pod(ns, master_pod(cluster, "train-step-mixed", args))
    master = MasterOnNode(cluster, "train-step-mixed")
    phase = master.wait_ended(150)
    log = master.log()
    assert phase == "Failed", log
    failure = log.strip().splitlines()[-1]
    assert "runs elastic-step 0.0.9 (protocol " in failure and "its master runs elastic-step 0.1.0 (protocol " in failure, log
    assert "--image" in failure, failure
    with open(master.path(f"{JOB_DIR}/events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    assert not [e for e in events if e["event"] in ("relaunched", "ready")], events
    assert [o["metadata"]["name"] for o in cluster.pods()] == ["train-step-mixed"]  # its worker pods are gone
