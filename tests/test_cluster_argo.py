"""The Argo path on the cluster stand-in (tests/cluster): the train step's pod is made from the
shipped WorkflowTemplate, rendered as a platform engineer renders it for `backend=kubernetes`
(`argo render --data-store s3://... --store-secret ... --store-endpoint ...`), submitted as a
Workflow and run by the Argo stand-in's controller (tests/cluster/workflow.py) as Argo runs it: an
`init` container, the `wait` container listed before `main`, main's command wrapped by the
executor, the workflow's service account, the pod owned by the Workflow, retried as the template's
`retryStrategy` says, its outputs uploaded by `wait` to the namespace's artifact repository. The
master in it trains on worker pods it creates through the API. Workers share nothing with the master pod: not its
image's first container, not its files (the dataset lives in a private bucket of an S3 server
that they read with the credentials of the Secret the template names), not its token.

The default render (the dataset an Argo artifact, a folder in the train step's pod only) cannot
work with worker pods: the master refuses it before it creates anything."""

from __future__ import annotations

import io
import json
import os
import queue
import shutil
import tarfile
import threading
import time
from unittest import mock

import pytest
import yaml
from kubernetes import client as k8s

from cluster import Cluster, role_rules, venv_image
from cluster.argo import ARGOEXEC_IMAGE, StepRefused, argoexec_image, step_pod
from cluster.argoretry import NodePhase, humanize_duration, parse_duration
from cluster.masterpod import MasterPodOnNode
from cluster.rbac import REPO, kustomize_namespace, read_manifests
from cluster.workflow import DEFAULT_REPOSITORY_ANNOTATION, SkippingClock, WorkflowController
from conftest import SLOW_MODEL
from elastic_step import defaults
from elastic_step.argo import RenderOptions
from elastic_step.argo.render import render_texts
from elastic_step.audit import audit_report
from mlflow_server import PIPELINES_USER, MlflowServer, pipelines_server
from stores import S3Server

pytestmark = pytest.mark.e2e

TEMPLATE = "training-workflowtemplate.yaml"
STORE_SECRET = "training-data-store"  # keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, as --store-secret wants
DATA_STORE = "s3://ml-data/elastic-step"
ARGO_RBAC = os.path.join(REPO, "deploy", "argo")  # the executor's Role for the steps' account
ARTIFACTS = "argo-artifacts"  # the namespace's artifact repository: a bucket, its keys in a Secret
JOB_DIR = "/tmp/job"  # the train template's job folder (steps.Layout.job_dir): main's own /tmp
# The run's parameters, as `argo submit -p NAME=VALUE` gives them; the others keep their defaults.
PARAMETERS = {"model-def": "slow_digits", "workers": "2:4", "epochs": "3", "minibatch-size": "16", "minibatches-per-task": "2",
              "checkpoint-steps": "0", "backend": "kubernetes"}
MLFLOW_USER = PIPELINES_USER


def rendered(**options) -> dict:
    """The training WorkflowTemplate as `elastic-step argo render` writes it, with MLflow's
    credentials from the Secret the shipped templates name (`make compile`'s render)."""
    options.setdefault("mlflow_credentials", defaults.MLFLOW_CREDENTIALS_SECRET)
    return yaml.safe_load(render_texts(["training"], RenderOptions(**options))[TEMPLATE])


def add_mlflow_credentials(cluster: Cluster, mlflow: MlflowServer | None = None) -> None:
    """The MLflow Secret the shipped templates take MLflow's URI and user from (no workflow
    parameter names a server), made as docs/kubernetes.md makes it: the pipelines user of the
    server behind basic auth, or, where no step reaches MLflow, a server that is not there."""
    uri, password = (mlflow.uri, mlflow.pipelines_password) if mlflow else ("http://127.0.0.1:9", "not-a-real-password")
    cluster.core().create_namespaced_secret(cluster.namespace, k8s.V1Secret(
        metadata=k8s.V1ObjectMeta(name=defaults.MLFLOW_CREDENTIALS_SECRET),
        string_data={"uri": uri, "username": MLFLOW_USER, "password": password}))


@pytest.fixture(scope="module")
def mlflow(tmp_path_factory):
    """MLflow behind basic auth, as deploy/mlflow ships it, with the pipelines' own user."""
    with pipelines_server(str(tmp_path_factory.mktemp("mlflow"))) as server:
        yield server


@pytest.fixture
def cluster(tmp_path):
    from elastic_step.images import default_image

    layer = tmp_path / "image-layer"  # the project image, with the user's model definition added
    layer.mkdir()
    shutil.copy(SLOW_MODEL, layer / "slow_digits.py")
    project = venv_image(default_image(), extra_path=[str(layer)])
    images = {default_image(): project, ARGOEXEC_IMAGE: argoexec_image(str(tmp_path / "argoexec"))}
    with Cluster(str(tmp_path / "cluster"), images=images) as c:
        print(f"kubelet runtime: {c.kubelet.mode}")
        for obj in kustomize_namespace(read_manifests(ARGO_RBAC), c.namespace):
            c.authorizer.apply(obj)
        yield c


@pytest.fixture
def s3():
    with S3Server() as server:
        yield server


class StepOnNode(MasterPodOnNode):
    """The train step pod's main container as the node has it: its /tmp (`docker cp`) and status."""

    def __init__(self, cluster: Cluster, name: str):
        super().__init__(cluster, name, JOB_DIR, what="step pod")

    def path(self, pod_path: str) -> str:
        return self.cluster.kubelet.container_file(self.cluster.namespace, self.name, "main", pod_path)


def add_artifact_repository(cluster: Cluster, s3: S3Server) -> None:
    """The namespace's default artifact repository as deploy/argo ships it (the
    `artifact-repositories` ConfigMap, its default key named by the annotation), with the bucket
    and endpoint set to the tests' S3 server as a user's overlay sets them to theirs, and the
    keys' Secret the user creates under the name it gives."""
    shipped = next(o for o in read_manifests(ARGO_RBAC) if o["kind"] == "ConfigMap")
    key = shipped["metadata"]["annotations"][DEFAULT_REPOSITORY_ANNOTATION]
    repository = yaml.safe_load(shipped["data"][key])
    repository["s3"].update(bucket=ARTIFACTS, endpoint=s3.endpoint.removeprefix("http://"), insecure=True)
    s3.create_bucket(ARTIFACTS)
    api = cluster.core()
    api.create_namespaced_secret(cluster.namespace, k8s.V1Secret(
        metadata=k8s.V1ObjectMeta(name=repository["s3"]["accessKeySecret"]["name"]),
        string_data={repository["s3"]["accessKeySecret"]["key"]: "AKIDTEST", repository["s3"]["secretKeySecret"]["key"]: "not-a-real-secret"}))
    shipped["metadata"]["namespace"] = cluster.namespace
    shipped["data"] = {key: yaml.safe_dump(repository)}
    api.create_namespaced_config_map(cluster.namespace, shipped)


def artifact_object(s3: S3Server, key: str) -> bytes:
    return s3.client().get_object(Bucket=ARTIFACTS, Key=key)["Body"].read()


def main_running(cluster: Cluster, pod: str) -> bool:
    statuses = cluster.core().read_namespaced_pod(pod, cluster.namespace).status.container_statuses or []
    return any(c.name == "main" and c.state.running for c in statuses)


def job_objects(cluster: Cluster) -> list[str]:
    """Every pod, Secret and NetworkPolicy the job made (the master labels them as its own)."""
    return [o["metadata"]["name"] for plural in ("pods", "secrets", "networkpolicies") for o in cluster.objects(plural)
            if o["metadata"].get("labels", {}).get("app.kubernetes.io/managed-by") == "elastic-step"]


def worker_pods_made(cluster: Cluster) -> list[dict]:
    return [e[4] for e in cluster.server.store.history if e[1] == "pods" and e[3] == "ADDED"
            and e[4]["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "worker"]


def test_the_argo_train_step_is_retried_then_trains_on_worker_pods_that_share_nothing_with_it_through_killed_oom_killed_and_paused_workers(
        tmp_path, digits, s3, cluster, mlflow):
    """The train step of the shipped WorkflowTemplate run by the Argo stand-in's controller
    (tests/cluster/workflow.py): its first attempt is SIGKILLed on the node as it starts (a node
    failure: main's exit code 137), retried as the template's retryStrategy says, and the second
    attempt trains through killed, OOM-killed and paused workers; its outputs end in the artifact
    repository of the namespace (`artifact-repositories`), uploaded by the `wait` container."""
    document = rendered(data_store=DATA_STORE, store_secret=STORE_SECRET, store_endpoint=s3.endpoint,
                        worker_cpu="1", worker_memory="1Gi")
    strategy = next(t for t in document["spec"]["templates"] if t["name"] == "train")["retryStrategy"]
    ns = cluster.namespace
    api = cluster.core()
    # What prepare-data left in the store (its own step is not run here), in a private bucket.
    s3.upload(digits, "ml-data", "elastic-step/wf-1/dataset")
    api.create_namespaced_secret(ns, k8s.V1Secret(metadata=k8s.V1ObjectMeta(name=STORE_SECRET), string_data={
        "AWS_ACCESS_KEY_ID": "AKIDTEST", "AWS_SECRET_ACCESS_KEY": "not-a-real-secret"}))
    add_mlflow_credentials(cluster, mlflow)
    add_artifact_repository(cluster, s3)
    clock = SkippingClock()  # the backoff is asserted, not waited out
    controller = WorkflowController(cluster, clock=clock.now, sleep=clock.sleep)
    # A floor every trained model passes: the test follows the blessed path to promote.
    workflow = controller.submit(document, "wf-1", {**PARAMETERS, "floor": "accuracy=0.5"})
    attempts: queue.Queue = queue.Queue()

    def prepare(pod: dict) -> None:
        main = pod["spec"]["containers"][1]
        assert main["args"][main["args"].index("--data") + 1] == "s3://ml-data/elastic-step/wf-1/dataset"
        # The operator's two additions to main's arguments (no workflow parameter reaches them): the
        # audit file this test checks, and a heartbeat timeout that keeps the paused worker's wait short.
        main["args"] += ["--audit", f"{JOB_DIR}/audit.jsonl", "--heartbeat-timeout", "4"]

    def on_attempt(index: int, pod: str) -> None:
        if index == 0:  # the node fails under the first attempt as soon as its main runs
            deadline = time.monotonic() + 60
            while not main_running(cluster, pod):
                assert time.monotonic() < deadline, f"{pod}: main did not start"
                time.sleep(0.05)
            cluster.kubelet.kill(ns, pod)
        attempts.put(pod)

    outcome: dict = {}
    runner = threading.Thread(target=lambda: outcome.update(node=controller.run_step(workflow, "train", prepare=prepare,
                                                                                      on_attempt=on_attempt)), daemon=True)
    runner.start()
    first, name = attempts.get(timeout=60), attempts.get(timeout=120)
    step = StepOnNode(cluster, name)

    started = time.monotonic()
    status = step.wait(lambda s: s["state"] == "running" and s["world_size"] == 4
                       and 0.05 < s["rows_done"] / s["rows_total"] < 0.35, timeout=150)
    print(f"job running on 4 worker pods after {time.monotonic() - started:.1f}s")
    victim = next(w for w in status["workers"] if w["rank"] == 1)
    cluster.kubelet.kill(ns, victim["pod"])  # docker kill: SIGKILL
    rows_at_kill = status["rows_done"]
    status = step.wait(lambda s: victim["id"] not in [w["id"] for w in s["workers"] if w["state"] == "live"]
                       and s["rows_done"] > rows_at_kill)
    # Once the survivors train again, one first worker hangs (docker pause), one goes over its
    # memory limit (a kernel OOM kill), and the third (which holds the model state) stays.
    first_workers = [w for w in status["workers"]
                     if w["state"] == "live" and w["id"].endswith(".1") and w["id"] != victim["id"] and w.get("pod")]
    assert len(first_workers) == 3, status["workers"]
    hung, oom = first_workers[0], first_workers[1]
    cluster.kubelet.pause(ns, hung["pod"])
    cluster.kubelet.fill_memory(ns, oom["pod"], 1200)
    step.wait(lambda s: not {hung["id"], oom["id"]} & {w["id"] for w in s["workers"] if w["state"] == "live"})

    runner.join(480)  # generous: the machine the suite runs on may be loaded
    log = step.log()
    assert "node" in outcome, f"the train step did not end\n{log}"
    node = outcome["node"]
    worker_logs = {n: [line for line in text.decode(errors="replace").splitlines() if "error" in line.lower()][-2:]
                   for (_, n), text in cluster.kubelet.past_logs.items() if n != name}
    assert node.phase == NodePhase.SUCCEEDED, f"{node}\n{log}\nworker logs: {worker_logs}"
    assert "argoexec wait: main exited with 0" in log
    print(f"job done {time.monotonic() - started:.1f}s after it started")
    # The retry, as the template's retryStrategy has it: main's 137 is retried after the backoff.
    assert [(a.name, a.phase, a.exit_code, a.message) for a in node.attempts] == [
        ("wf-1.train(0)", NodePhase.FAILED, "137", "main: Error (exit code 137)"), ("wf-1.train(1)", NodePhase.SUCCEEDED, "0", "")]
    assert node.messages == [f"Backoff for {humanize_duration(parse_duration(strategy['backoff']['duration']))}", ""]
    assert [a.pod for a in node.attempts] == [first, name]

    report = audit_report(step.path(f"{JOB_DIR}/audit.jsonl"), digits, int(PARAMETERS["epochs"]))
    assert report["exact"] and report["rows_applied"] == report["rows_expected"], report
    with open(step.path(f"{JOB_DIR}/result.json")) as f:
        result = json.load(f)
    assert result["test_metrics"]["accuracy"] >= 0.85, result["test_metrics"]  # what the local backend gets (>= 0.85)
    with open(step.path(f"{JOB_DIR}/events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    died = {e["worker"]: e for e in events if e["event"] == "died"}
    assert set(died) == {victim["id"], hung["id"], oom["id"]}, died
    assert "OOMKilled" in died[oom["id"]]["reason"], died
    assert {e["worker"] for e in events if e["event"] == "relaunched"} == {victim["id"], hung["id"]}

    # The step's outputs, as the wait container reported and uploaded them: the parameters the
    # evaluate step takes, the metrics file and the model folder (tar+gzip, Argo's default).
    parameters = {p["name"]: p["value"] for p in node.outputs["parameters"]}
    assert f"mlflow: run {parameters['run_id']} at " in log and f"; model {parameters['model_uri']}\n" in log, parameters
    keys = {a["name"]: a["s3"]["key"] for a in node.outputs["artifacts"]}
    assert keys == {n: f"elastic-step/wf-1/{name}/{n}.tgz" for n in ("metrics", "model")}  # deploy/argo's keyFormat
    with tarfile.open(fileobj=io.BytesIO(artifact_object(s3, keys["metrics"])), mode="r:gz") as tar:
        assert json.load(tar.extractfile("metrics.json")) == result["test_metrics"]
    with tarfile.open(fileobj=io.BytesIO(artifact_object(s3, keys["model"])), mode="r:gz") as tar:
        model = step.path("/tmp/outputs/model")  # what main wrote, as the node holds it
        assert sorted(tar.getnames()) == ["model"] + [f"model/{n}" for n in sorted(os.listdir(model))], tar.getnames()
        with open(os.path.join(model, "model.bin"), "rb") as f:
            assert tar.extractfile("model/model.bin").read() == f.read()

    # The workers run main's image (not the executor's, listed first), as their own account
    # (not the workflow's), owned by the step's pod, with the store's credentials by reference;
    # the step's pods are owned by the Workflow.
    master = api.read_namespaced_pod(name, ns)
    assert [(r.kind, r.uid) for r in master.metadata.owner_references] == [("Workflow", workflow["metadata"]["uid"])]
    workers = [w for w in worker_pods_made(cluster) if w["metadata"]["ownerReferences"][0]["uid"] == master.metadata.uid]
    assert len(workers) == 6, [w["metadata"]["name"] for w in workers]  # 4 and two replacements (none for the OOM)
    for worker in workers:
        container = worker["spec"]["containers"][0]
        assert container["image"] == next(t for t in document["spec"]["templates"] if t["name"] == "train")["container"]["image"]
        assert container["resources"]["limits"]["memory"] == "1Gi"
        assert worker["spec"]["serviceAccountName"] != document["spec"]["serviceAccountName"]
        env = {e["name"]: e for e in container["env"]}
        assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {"name": STORE_SECRET, "key": "AWS_SECRET_ACCESS_KEY"}
        assert env["AWS_ENDPOINT_URL"]["value"] == s3.endpoint

    assert job_objects(cluster) == []  # no pod, Secret or NetworkPolicy of the job is left
    assert cluster.refused() == set()
    used = cluster.used()
    assert {n for _, _, n in used} == {ns}
    # the master's calls and the executor's report, with the one account, as deploy/ grants them
    assert {(verb, resource) for verb, resource, _ in used} == role_rules() | role_rules(ARGO_RBAC)

    # The steps after train find its run in MLflow behind auth, as the same Secret's user:
    # evaluate blesses it, export registers it, promote makes that version the champion.
    outputs = {f"tasks.train.outputs.parameters.{k}": v for k, v in parameters.items()}
    for template in ("evaluate", "export", "promote"):
        step_node = controller.run_step(workflow, template, outputs, timeout=300)
        pod_log = cluster.core().read_namespaced_pod_log(step_node.attempts[-1].pod, ns, container="main")
        assert step_node.phase == NodePhase.SUCCEEDED, f"{template}: {step_node}\n{pod_log}"
        outputs |= {f"tasks.{template}.outputs.parameters.{p['name']}": p["value"] for p in step_node.outputs["parameters"]}
    assert outputs["tasks.evaluate.outputs.parameters.blessed"] == "true", outputs
    version = outputs["tasks.export.outputs.parameters.model_version"]
    assert outputs["tasks.promote.outputs.parameters.champion_version"] == version, outputs
    import mlflow as mlflow_client

    with mock.patch.dict(os.environ, mlflow.credentials_env(MLFLOW_USER, mlflow.pipelines_password)):
        registered = mlflow_client.MlflowClient(mlflow.uri).get_model_version_by_alias(defaults.REGISTERED_MODEL, "champion")
    assert (registered.version, registered.run_id) == (version, parameters["run_id"]), registered


def test_the_default_render_with_worker_pods_is_refused_before_anything_is_created(tmp_path, digits, s3, cluster):
    """Without --data-store the dataset is an Argo artifact: a folder in the train step's pod,
    which no worker pod can read. The master says so and exits 2 (Argo does not retry it)."""
    document = rendered()
    s3.upload(digits, "artifacts", "wf-2/prepare-data/dataset", public=True)
    add_mlflow_credentials(cluster)
    ns = cluster.namespace
    pod = step_pod(document, "train", "wf-2", {}, PARAMETERS,
                   {"dataset": {"bucket": "artifacts", "key": "wf-2/prepare-data/dataset", "endpoint": s3.endpoint}})
    cluster.core().create_namespaced_pod(ns, pod)
    step = StepOnNode(cluster, pod["metadata"]["name"])
    assert step.wait_ended(120) == "Failed", step.log()
    log = step.log()
    assert "argoexec wait: main exited with 2" in log, log
    refusal = [line for line in log.splitlines() if "error:" in line and not line.startswith("argoexec")]  # main's, not wait's
    assert len(refusal) == 1 and "--data '/tmp/inputs/dataset' is a local path" in refusal[0] and "--data-store" in refusal[0], log
    assert not os.path.exists(step.path(JOB_DIR))
    assert worker_pods_made(cluster) == [] and job_objects(cluster) == []
    assert cluster.used() == set() and cluster.refused() == set()  # not one API call


@pytest.mark.parametrize("data", ["prepared/digits", "/data/digits", "file:///data/digits"])
def test_a_local_data_path_is_refused_with_kubernetes_in_every_form(tmp_path, data):
    from conftest import cli

    env = {**os.environ, "ELASTIC_STEP_POD_IP": "127.0.0.1"}  # in a pod: only the data is wrong
    done = cli("train", "--backend", "kubernetes", "--model-def", "m", "--data", data, "--job-dir", str(tmp_path / "j"),
               env=env, cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == "", done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--data {data!r}" in lines[0] and "s3://" in lines[0], done.stderr
    assert not os.path.exists(tmp_path / "j")


def test_an_object_store_uri_passes_the_check():
    from elastic_step.backends.kubernetes.options import check_data_readable_by_pods

    for uri in ("s3://ml-data/x/dataset", "gs://b/dataset", "minio://b/k"):
        check_data_readable_by_pods(uri)


def test_worker_resources_are_fixed_at_render_time_as_checked_quantities():
    from elastic_step.errors import ConfigError

    args = rendered(worker_cpu="500m", worker_memory="2Gi")["spec"]["templates"]
    train = next(t for t in args if t["name"] == "train")["container"]["args"]
    assert train[train.index("--worker-cpu") + 1] == "500m" and train[train.index("--worker-memory") + 1] == "2Gi"
    assert "--worker-memory" not in next(t for t in rendered()["spec"]["templates"] if t["name"] == "train")["container"]["args"]
    with pytest.raises(ConfigError, match="--worker-memory 'lots'"):
        RenderOptions(worker_memory="lots").validate()


def test_the_stand_in_refuses_a_step_as_argo_does_when_an_input_is_not_supplied_or_a_reference_not_resolved():
    """The train step's inputs come from the DAG's task, as Argo resolves them: a template input
    that the DAG does not pass (a new flag added to one and not the other) is refused, never
    left as literal text in the step's arguments."""
    document = rendered(data_store=DATA_STORE, store_secret=STORE_SECRET)
    pod = step_pod(document, "train", "wf-3", {}, PARAMETERS, {})
    args = pod["spec"]["containers"][1]["args"]
    assert args[args.index("--workers") + 1] == "2:4" and args[args.index("--spares") + 1] == "0"  # a default
    assert "{{" not in json.dumps(pod)
    dag = next(t for t in document["spec"]["templates"] if "dag" in t)
    train_task = next(t for t in dag["dag"]["tasks"] if t["template"] == "train")
    train_task["arguments"]["parameters"] = [p for p in train_task["arguments"]["parameters"] if p["name"] != "spares"]
    with pytest.raises(StepRefused, match=r"^templates\.train\.inputs\.parameters\.spares was not supplied$"):
        step_pod(document, "train", "wf-3", {}, PARAMETERS, {})
    with pytest.raises(StepRefused, match=r"failed to resolve \{\{tasks\.train\.outputs\.parameters\.run_id\}\}"):
        step_pod(document, "evaluate", "wf-3", {}, PARAMETERS, {})
    evaluate = step_pod(document, "evaluate", "wf-3", {"tasks.train.outputs.parameters.run_id": "r1",
                                                        "tasks.train.outputs.parameters.model_uri": "runs:/r1/model"}, PARAMETERS, {})
    assert "r1" in evaluate["spec"]["containers"][1]["args"]
