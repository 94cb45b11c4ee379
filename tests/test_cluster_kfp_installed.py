"""Both compiled pipelines' train task on the cluster stand-in as an installed Kubeflow Pipelines
runs it, under KFP's own roles (tests/cluster/platform), in both of KFP's modes:

- single-user (standalone) KFP: namespace `kubeflow`, the task's account KFP's `pipeline-runner`
  with deploy/kfp/single-user applied, no `kfp-launcher` ConfigMap (KFP's default root);
- multi-user Kubeflow: a profile namespace, the account `default-editor` (kubeflow-edit) with
  deploy/kfp/multi-user applied, `kfp-launcher` and the store Secret as Kubeflow's profile
  controller puts them in a profile, and Istio's injection on (`istio-injection=enabled`,
  tests/cluster/sidecar.py): the task's pod gets the proxy as a native sidecar, which ends with
  it, and takes none of the master's inbound ports (the compiled task's annotation), so the worker
  pods, which opt out of the mesh, reach its ports under STRICT mTLS too (judged from the
  annotations: Envoy is not played).

KFP's driver (tests/cluster/kfp_driver.py) builds the executor input and the pod from the
COMPILED pipeline; KFP's launcher (tests/cluster/kfp_launcher.py) runs in the pod's `main`
container with the pod's own token: it reads `kfp-launcher` and the Secret
`mlpipeline-minio-artifact`, downloads the dataset prepare-data left at
`minio://mlpipeline/v2/artifacts/PIPELINE/RUN/prepare-data/dataset` from KFP's default endpoint
`minio-service.kubeflow:9000` (the tests' S3 server stands behind that Service), runs the
component, and uploads its outputs where KFP puts them. The master in it trains on worker pods;
one worker is SIGKILLed mid-training; every row is applied exactly once. MLflow runs behind basic
auth as deploy/mlflow ships it; its URI and the pipelines user's credentials reach the task only
through a Secret (kfp-kubernetes secret-as-env: the compiled pipeline's own where it ships one,
else added as a platform engineer adds it), and never reach the worker pods.

What a platform engineer adds to the task, as the component's docstring says: the store endpoint
for the workers as env (`set_env_variable`). Not modelled: MLMD and the cache (the launcher logs
what it would publish), the other tasks of the pipeline (the dataset is put where prepare-data
would leave it), KFP's API server."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from unittest import mock

import pytest
from kubernetes import client as k8s

from cluster import Cluster, venv_image
from cluster.argo import ARGOEXEC_IMAGE, argoexec_image
from cluster.kfp_driver import LAUNCHER_IMAGE, TaskDriver, kfp_launcher_image, pipeline_root
from cluster.rbac import REPO, read_manifests, read_platform, service_account_user
from cluster.sidecar import INJECTION_LABEL, PROXY_IMAGE, IstioInjector, inbound_intercepted, opted_out, proxy_image
from conftest import SLOW_MODEL
from elastic_step.audit import audit_report
from elastic_step.protocol import WorkerEnv
from mlflow_server import PIPELINES_USER, MlflowServer, pipelines_server
from stores import REGION, S3Server
from test_cluster_argo import JOB_DIR, StepOnNode, job_objects, worker_pods_made

pytestmark = pytest.mark.e2e

RUN_ID = "7d1e2f3a-4b5c-4d6e-8f90-a1b2c3d4e5f6"
STORE_SECRET = "mlpipeline-minio-artifact"  # KFP's own, keys accesskey / secretkey
MINIO_SERVICE = "minio-service.kubeflow:9000"  # KFP's default MinIO endpoint
BUCKET = "mlpipeline"
MLFLOW_SECRET, MLFLOW_USER = "mlflow-credentials", PIPELINES_USER  # the MLflow user's Secret: keys uri, username, password
PIPELINES = {"training": os.path.join(REPO, "pipelines", "compiled", "training_pipeline.yaml"),
             "retraining": os.path.join(REPO, "pipelines", "compiled", "retraining_pipeline.yaml")}
PARAMETERS = {"backend": "kubernetes", "model_def": "slow_digits", "workers": "2:3", "epochs": 2, "minibatch_size": 16,
              "minibatches_per_task": 2, "checkpoint_steps": 0, "job_dir": JOB_DIR}


@dataclass(frozen=True)
class Mode:
    name: str
    namespace: str
    account: str
    platform: str
    overlay: str
    launcher_config: bool  # whether the namespace has a `kfp-launcher` ConfigMap
    mesh: bool = False  # whether Istio injects its proxy into the namespace's pods (a Kubeflow profile)


SINGLE_USER = Mode("single-user", "kubeflow", "pipeline-runner", "kfp-single-user", "single-user", False)
MULTI_USER = Mode("multi-user", "kubeflow-user-example-com", "default-editor", "kubeflow-multi-user", "multi-user", True, mesh=True)


@pytest.fixture(scope="module")
def s3():
    with S3Server() as server:
        yield server


@pytest.fixture(scope="module")
def mlflow(tmp_path_factory):
    """MLflow behind basic auth, as deploy/mlflow ships it, with the pipelines' own user."""
    with pipelines_server(str(tmp_path_factory.mktemp("mlflow"))) as server:
        yield server


# The MLflow Secret on the task, as kfp-kubernetes compiles `use_secret_as_env(task, MLFLOW_SECRET,
# {"uri": "MLFLOW_TRACKING_URI", "username": "MLFLOW_TRACKING_USERNAME", "password": "MLFLOW_TRACKING_PASSWORD"})`.
MLFLOW_SECRET_AS_ENV = {"secretAsEnv": [{"secretName": MLFLOW_SECRET, "keyToEnv": [
    {"secretKey": "uri", "envVar": "MLFLOW_TRACKING_URI"}, {"secretKey": "username", "envVar": "MLFLOW_TRACKING_USERNAME"},
    {"secretKey": "password", "envVar": "MLFLOW_TRACKING_PASSWORD"}]}]}


def make_cluster(tmp_path, mode: Mode, s3: S3Server) -> Cluster:
    from elastic_step.images import default_image

    layer = tmp_path / "image-layer"  # the project image with the user's model definition added
    layer.mkdir()
    shutil.copy(SLOW_MODEL, layer / "slow_digits.py")
    # The cluster's DNS and kube-proxy for KFP's MinIO Service: the S3 server behind it.
    services = {MINIO_SERVICE: s3.endpoint.removeprefix("http://")}
    images = {default_image(): venv_image(default_image(), extra_path=[str(layer)]),
              ARGOEXEC_IMAGE: argoexec_image(str(tmp_path / "argoexec")),
              LAUNCHER_IMAGE: kfp_launcher_image(str(tmp_path / "kfp-launcher"), services),
              PROXY_IMAGE: proxy_image(str(tmp_path / "istio-proxy"))}
    return Cluster(str(tmp_path / "cluster"), namespace=mode.namespace, images=images)


def install(cluster: Cluster, mode: Mode) -> None:
    """KFP's roles, then deploy/kfp/MODE (`kubectl apply -k`), then what KFP (or Kubeflow's
    profile controller) puts in the namespace: the store's Secret and, in a profile, kfp-launcher."""
    cluster.apply(read_platform(mode.platform), mode.namespace)
    cluster.apply(read_manifests(os.path.join(REPO, "deploy", "kfp", mode.overlay)), mode.namespace)
    api = cluster.core()
    if mode.mesh:  # the profile controller's label, and Istio's injector
        api.patch_namespace(mode.namespace, {"metadata": {"labels": {INJECTION_LABEL: "enabled"}}})
        cluster.server.mutators.append(IstioInjector().inject)
    api.create_namespaced_secret(mode.namespace, k8s.V1Secret(metadata=k8s.V1ObjectMeta(name=STORE_SECRET), string_data={
        "accesskey": "minio", "secretkey": "not-a-real-secret"}))
    # The workers' own: read-only keys for the data (docs/kubernetes.md), never KFP's whole-store Secret.
    api.create_namespaced_secret(mode.namespace, k8s.V1Secret(metadata=k8s.V1ObjectMeta(name="elastic-step-data-reader"),
                                                              string_data={"AWS_ACCESS_KEY_ID": "minio",
                                                                           "AWS_SECRET_ACCESS_KEY": "not-a-real-secret"}))
    if mode.launcher_config:
        api.create_namespaced_config_map(mode.namespace, k8s.V1ConfigMap(metadata=k8s.V1ObjectMeta(name="kfp-launcher"),
                                                                         data={"defaultPipelineRoot": "minio://mlpipeline/v2/artifacts"}))


def main_log(cluster: Cluster, pod: str) -> str:
    """The log of the pod's `main` (the launcher and the component it runs)."""
    return cluster.core().read_namespaced_pod_log(pod, cluster.namespace, container="main")


def mlflow_secret(cluster: Cluster, driver: TaskDriver, mlflow: MlflowServer) -> dict | None:
    """The MLflow user's Secret, as the platform engineer creates it: under the name and keys the
    compiled task takes MLFLOW_TRACKING_URI from, if the pipeline ships that; else under
    MLFLOW_SECRET, and the `kfp-kubernetes` config that gives it to the task (returned)."""
    executor = driver.spec["components"][driver.component_name]["executorLabel"]
    config = (driver.platform.get("deploymentSpec") or {}).get("executors", {}).get(executor) or {}
    shipped = next((e for e in config.get("secretAsEnv") or []
                    if "MLFLOW_TRACKING_URI" in [k["envVar"] for k in e["keyToEnv"]]), None)
    entry = shipped or MLFLOW_SECRET_AS_ENV["secretAsEnv"][0]
    values = {"MLFLOW_TRACKING_URI": mlflow.uri, "MLFLOW_TRACKING_USERNAME": MLFLOW_USER,
              "MLFLOW_TRACKING_PASSWORD": mlflow.pipelines_password}
    cluster.core().create_namespaced_secret(cluster.namespace, k8s.V1Secret(
        metadata=k8s.V1ObjectMeta(name=entry["secretName"]),
        string_data={k["secretKey"]: values[k["envVar"]] for k in entry["keyToEnv"] if k["envVar"] in values}))
    return None if shipped else MLFLOW_SECRET_AS_ENV


def wait_for(cluster: Cluster, task: StepOnNode, predicate, timeout: float) -> dict:
    """The master's status once `predicate` holds; the task's own log if it ends first."""
    deadline, status = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        if task.phase() in ("Succeeded", "Failed"):
            raise AssertionError(f"the task ended ({task.phase()}) first; last status {status}\n{main_log(cluster, task.name)}")
        status = task.status()
        if status is not None and predicate(status):
            return status
        time.sleep(0.1)
    raise AssertionError(f"not reached in {timeout}s; last status {status}\n{main_log(cluster, task.name)}")


def published(log: str) -> dict:
    line = next(line for line in log.splitlines() if line.startswith("kfp-launcher: publish "))
    return json.loads(line.removeprefix("kfp-launcher: publish "))


# Both compiled pipelines in both modes: each pairing is a pipeline a user of that installation runs.
@pytest.mark.parametrize("pipeline", ["training", "retraining"])
@pytest.mark.parametrize("mode", [SINGLE_USER, MULTI_USER], ids=lambda mode: mode.name)
def test_the_compiled_train_task_runs_as_installed_kfp_runs_it(tmp_path, digits, s3, mlflow, mode, pipeline):
    with make_cluster(tmp_path, mode, s3) as cluster:
        print(f"kubelet runtime: {cluster.kubelet.mode}")
        if cluster.kubelet.isolation not in ("namespaces", "docker"):
            pytest.fail(f"this test needs a container's own filesystem (runtime: {cluster.kubelet.mode})")
        run_train_task(cluster, mode, pipeline, digits, s3, mlflow)


def run_train_task(cluster: Cluster, mode: Mode, pipeline: str, digits: str, s3: S3Server, mlflow: MlflowServer) -> None:
    ns, user = mode.namespace, service_account_user(mode.namespace, mode.account)
    install(cluster, mode)
    run_id = RUN_ID[:-2] + ("01" if pipeline == "training" else "02") + mode.name[:1]
    # The driver, with the run's account: the pipeline root from kfp-launcher, the executor input.
    root = pipeline_root(cluster.core(cluster.token_for(ns, mode.account)), ns)
    assert root == "minio://mlpipeline/v2/artifacts"
    driver = TaskDriver("train-elastic", run_id, root, PIPELINES[pipeline])
    dataset_uri = driver.upstream_uri("prepare-data", "dataset")
    s3.upload(digits, BUCKET, dataset_uri.removeprefix(f"minio://{BUCKET}/"))  # private: a reader needs the Secret's keys
    # No mlflow_uri: MLflow's URI and the user's credentials reach the pod only through its Secret.
    executor = driver.executor_input({**PARAMETERS, "mlflow_uri": "", "experiment": f"kfp-{mode.name}-{pipeline}"})
    pod = driver.pod(executor, mode.account, env={"AWS_ENDPOINT_URL": s3.endpoint, "AWS_REGION": REGION},
                     platform_additions=mlflow_secret(cluster, driver, mlflow))
    assert mlflow.pipelines_password not in json.dumps(pod)
    cluster.core().create_namespaced_pod(ns, pod)
    name = pod["metadata"]["name"]
    task = StepOnNode(cluster, name)

    started = time.monotonic()
    status = wait_for(cluster, task, lambda s: s["state"] == "running" and s["world_size"] >= 2
                      and 0.1 < s["rows_done"] / s["rows_total"] < 0.5, timeout=150)
    victim = next(w for w in status["workers"] if w["rank"] == 1)
    cluster.kubelet.kill(ns, victim["pod"])  # SIGKILL
    phase = task.wait_ended(150)
    log = main_log(cluster, name)
    worker_logs = {n: [line for line in text.decode(errors="replace").splitlines() if "error" in line.lower()][-2:]
                   for (_, n), text in cluster.kubelet.past_logs.items() if n != name}
    assert phase == "Succeeded", f"{log}\nworker logs: {worker_logs}"
    print(f"{mode.name} {pipeline}: task pod done {time.monotonic() - started:.1f}s after it was created")

    # Every row of every epoch applied exactly once, by worker pods, through the SIGKILL.
    report = audit_report(task.path(f"{JOB_DIR}/audit.jsonl"), digits, PARAMETERS["epochs"])
    assert report["exact"] and report["rows_applied"] == report["rows_expected"], report
    with open(task.path(f"{JOB_DIR}/events.jsonl")) as f:
        died = [json.loads(line) for line in f if json.loads(line)["event"] == "died"]
    assert [e["worker"] for e in died] == [victim["id"]], died
    workers = worker_pods_made(cluster)
    assert len(workers) >= 3, [w["metadata"]["name"] for w in workers]  # two or more, and the killed one's successor
    if mode.mesh:  # the task's pod in the mesh, its inbound ports left to the master; the workers out of it
        task_pod = cluster.server.get("pods", ns, name)
        assert [(c["name"], c.get("restartPolicy")) for c in task_pod["spec"]["initContainers"]][0] == ("istio-proxy", "Always")
        master_port = int(next(e["value"] for e in workers[0]["spec"]["containers"][0]["env"]
                               if e["name"] == WorkerEnv.MASTER_URL).rsplit(":", 1)[1].split("/")[0])
        assert not inbound_intercepted(task_pod, master_port), task_pod["metadata"]["annotations"]
        assert all(opted_out(w) and not w["spec"].get("initContainers") for w in workers)
    for worker in workers:
        assert worker["spec"]["serviceAccountName"] != mode.account
        # The workers never call MLflow: they get neither the password nor a reference to it.
        assert "MLFLOW_TRACKING_PASSWORD" not in {e["name"] for e in worker["spec"]["containers"][0].get("env") or []}

    # The launcher uploaded the outputs under the run's root, and published them.
    outputs = published(log)
    assert outputs["state"] == "COMPLETE" and outputs["pod"] == name, outputs
    model = outputs["artifacts"]["model"]
    assert model["uri"] == f"{root}/{driver.pipeline}/{run_id}/train-elastic/model", model
    assert model["metadata"]["mlflow_run_id"] and model["metadata"]["steps"] > 0, model
    assert outputs["artifacts"]["metrics"]["metadata"]["relaunches"] >= 1
    keys = {o["Key"] for o in s3.client().list_objects_v2(Bucket=BUCKET, Prefix=f"v2/artifacts/{driver.pipeline}/{run_id}/train-elastic/")
            .get("Contents") or []}
    prefix = f"v2/artifacts/{driver.pipeline}/{run_id}/train-elastic"
    assert f"{prefix}/model/model.json" in keys and f"{prefix}/report" in keys, sorted(keys)
    assert b"<html" in s3.client().get_object(Bucket=BUCKET, Key=f"{prefix}/report")["Body"].read().lower()
    import mlflow as mlflow_client

    with mock.patch.dict(os.environ, mlflow.credentials_env(MLFLOW_USER, mlflow.pipelines_password)):
        run = mlflow_client.MlflowClient(mlflow.uri).get_run(model["metadata"]["mlflow_run_id"])
    assert run.info.status == "FINISHED", run.info

    # Under KFP's own roles and deploy/kfp/MODE only: nothing refused; the launcher's reads made
    # with the task's own account; no object of the job left.
    assert cluster.refused(user) == set()
    used = cluster.used(user)
    assert {("get", "secrets", ns), ("get", "configmaps", ns)} <= used, sorted(used)
    assert {n for _, _, n in used} == {ns}
    assert cluster.used(cluster.service_account_user) == set()  # deploy/rbac's own account played no part
    assert job_objects(cluster) == []


def test_kfps_launcher_refuses_in_its_own_words_when_the_task_account_may_not_read_its_config_or_the_store_secret_is_missing(
        tmp_path, s3):
    mode = SINGLE_USER
    with make_cluster(tmp_path, mode, s3) as cluster:
        ns, api = mode.namespace, cluster.core()
        cluster.apply(read_platform(mode.platform), ns)
        cluster.apply(read_manifests(os.path.join(REPO, "deploy", "kfp", mode.overlay)), ns)

        def failed_task(account: str) -> str:
            driver = TaskDriver("train-elastic", f"{account[:5]}-{RUN_ID}", "minio://mlpipeline/v2/artifacts", PIPELINES["training"])
            pod = driver.pod(driver.executor_input(PARAMETERS), account)
            api.create_namespaced_pod(ns, pod)
            task = StepOnNode(cluster, pod["metadata"]["name"])
            assert task.wait_ended(60) == "Failed", cluster.core().read_namespaced_pod(pod["metadata"]["name"], ns).status
            return [line for line in main_log(cluster, pod["metadata"]["name"]).splitlines() if line.startswith("failed to execute component")][0]

        # pipeline-runner may read both, but KFP's store Secret is not there: the launcher says which.
        assert failed_task(mode.account) == (
            'failed to execute component: Failed to open bucket "mlpipeline": failed to retrieve credentials for bucket '
            'mlpipeline: failed to get Bucket credentials from secret name="mlpipeline-minio-artifact" namespace="kubeflow": '
            'secrets "mlpipeline-minio-artifact" not found')
        # The namespace's `default` account may read neither: the launcher stops at its configuration.
        assert failed_task("default") == (
            'failed to execute component: configmaps "kfp-launcher" is forbidden: User "system:serviceaccount:kubeflow:default" '
            'cannot get resource "configmaps" in API group "" in the namespace "kubeflow"')
        assert cluster.used(service_account_user(ns, "default")) == set()
