"""The KFP path on the cluster stand-in with deploy/'s own service account: the `train-elastic`
task of the COMPILED `pipelines/compiled/training_pipeline.yaml` (`backend=kubernetes`) run by
KFP's driver and launcher as the stand-in plays them (tests/cluster/kfp_driver.py,
kfp_launcher.py) in a KFP run whose service account is `elastic-step-runner`: deploy/rbac's Role
for the master, and deploy/kfp/launcher's Role for the two reads KFP's launcher makes with the
task pod's token (ConfigMap `kfp-launcher`, Secret `mlpipeline-minio-artifact`, by name only).

The executor's image, command and args come from its deploymentSpec, the `kfp-kubernetes` config
from the platform spec (the downward-API env the master needs, the pod labels, the store's keys
from KFP's own `mlpipeline-minio-artifact` Secret). The dataset is prepare-data's output in KFP's
artifact store (a private bucket of the tests' S3 server, behind `minio-service.kubeflow:9000`),
which the launcher downloads and the workers read by its URI. What a platform engineer adds to the
task, as the component's docstring says: the store endpoint as env (`set_env_variable`).

Not modelled: MLMD, the cache, KFP's API server; the other tasks of the pipeline (the prepared data
is put where prepare-data would leave it). KFP's own service accounts, in both of KFP's modes:
tests/test_cluster_kfp_installed.py."""

from __future__ import annotations

import json
import time

import pytest
from kubernetes import client as k8s

from cluster import Cluster, role_rules, venv_image
from cluster.argo import ARGOEXEC_IMAGE, argoexec_image
from cluster.kfp_driver import LAUNCHER_IMAGE, TaskDriver, kfp_launcher_image, pipeline_root
from elastic_step.audit import audit_report
from stores import REGION, S3Server
from test_cluster_argo import JOB_DIR, StepOnNode, job_objects, worker_pods_made
from test_cluster_kfp_installed import BUCKET, MINIO_SERVICE, main_log, published

pytestmark = pytest.mark.e2e

RUN_ID = "5f0c1d2e-3b4a-4c5d-8e9f-0a1b2c3d4e5f"
STORE_SECRET = "mlpipeline-minio-artifact"  # KFP's own, keys accesskey / secretkey
WORKER_STORE_SECRET = "elastic-step-data-reader"  # what worker pods read the data with where the task's keys are KFP's
PARAMETERS = {"backend": "kubernetes", "workers": "2:3", "epochs": 2, "minibatch_size": 16, "minibatches_per_task": 2,
              "checkpoint_steps": 0, "mlflow_uri": "", "job_dir": JOB_DIR}
# The MLflow Secret the compiled task takes its tracking URI from. This test is about deploy/'s own
# account, so its run stays in the pod (a SQLite file); MLflow behind auth, reached through this
# Secret: tests/test_cluster_kfp_installed.py.
MLFLOW_SECRET = {"uri": "sqlite:////tmp/mlflow.db"}


@pytest.fixture
def s3():
    with S3Server() as server:
        yield server


@pytest.fixture
def cluster(tmp_path, s3):
    from elastic_step.images import default_image

    images = {default_image(): venv_image(default_image()), ARGOEXEC_IMAGE: argoexec_image(str(tmp_path / "argoexec")),
              LAUNCHER_IMAGE: kfp_launcher_image(str(tmp_path / "kfp-launcher"), {MINIO_SERVICE: s3.endpoint.removeprefix("http://")})}
    with Cluster(str(tmp_path / "cluster"), images=images) as c:
        print(f"kubelet runtime: {c.kubelet.mode}")
        yield c


def test_the_compiled_kfp_train_task_trains_on_worker_pods_that_read_the_dataset_uri_from_the_store(digits, s3, cluster):
    if cluster.kubelet.isolation not in ("namespaces", "docker"):
        pytest.fail(f"this test needs a container's own filesystem (runtime: {cluster.kubelet.mode})")
    ns = cluster.namespace
    api = cluster.core()
    api.create_namespaced_secret(ns, k8s.V1Secret(metadata=k8s.V1ObjectMeta(name=STORE_SECRET), string_data={
        "accesskey": "AKIDKFPTEST", "secretkey": "not-a-real-secret"}))
    # The workers' own (docs/kubernetes.md: read-only keys for the dataset; the stand-in store has one user).
    api.create_namespaced_secret(ns, k8s.V1Secret(metadata=k8s.V1ObjectMeta(name=WORKER_STORE_SECRET), string_data={
        "AWS_ACCESS_KEY_ID": "AKIDKFPTEST", "AWS_SECRET_ACCESS_KEY": "not-a-real-secret"}))
    api.create_namespaced_secret(ns, k8s.V1Secret(metadata=k8s.V1ObjectMeta(name="mlflow-credentials"), string_data=MLFLOW_SECRET))
    root = pipeline_root(cluster.core(cluster.token_for(ns, cluster.service_account)), ns)
    driver = TaskDriver("train-elastic", RUN_ID, root)
    dataset_uri = driver.upstream_uri("prepare-data", "dataset")
    s3.upload(digits, BUCKET, dataset_uri.removeprefix(f"minio://{BUCKET}/"))  # private: a reader needs the Secret's keys
    executor = driver.executor_input(PARAMETERS)
    pod = driver.pod(executor, cluster.service_account, env={"AWS_ENDPOINT_URL": s3.endpoint, "AWS_REGION": REGION})
    main = pod["spec"]["containers"][-1]
    assert [c["name"] for c in pod["spec"]["containers"]] == ["wait", "main"]
    assert [c["name"] for c in pod["spec"]["initContainers"]] == ["init", "kfp-launcher"]
    assert main["image"] == cluster.project_image and "kfp.dsl.executor_main" in " ".join(main["args"])
    assert main["args"][-4:] == ["--executor_input", "{{$}}", "--function_to_execute", "train_elastic"]  # the launcher fills it
    env = {e["name"]: e for e in main["env"]}
    assert env["ELASTIC_STEP_POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"  # from the platform spec
    # the store's keys too: the compiled pipeline takes them from KFP's own MinIO Secret
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {"name": STORE_SECRET, "key": "accesskey", "optional": True}
    assert executor["inputs"]["parameterValues"]["pipeline_run_id"] == RUN_ID
    assert executor["inputs"]["artifacts"]["dataset"]["artifacts"][0]["uri"] == dataset_uri
    assert pod["metadata"]["labels"]["app.kubernetes.io/part-of"] == "elastic-step"
    api.create_namespaced_pod(ns, pod)
    name = pod["metadata"]["name"]
    task = StepOnNode(cluster, name)

    started = time.monotonic()
    phase = task.wait_ended(150)
    log = main_log(cluster, name)
    worker_logs = {n: [line for line in text.decode(errors="replace").splitlines() if "error" in line.lower()][-2:]
                   for (_, n), text in cluster.kubelet.past_logs.items() if n != name}
    assert phase == "Succeeded", f"{log}\nworker logs: {worker_logs}"
    print(f"task pod done {time.monotonic() - started:.1f}s after it was created")

    # Every row of every epoch applied exactly once, by worker pods.
    report = audit_report(task.path(f"{JOB_DIR}/audit.jsonl"), digits, PARAMETERS["epochs"])
    assert report["exact"] and report["rows_applied"] == report["rows_expected"], report
    master = api.read_namespaced_pod(name, ns)
    workers = worker_pods_made(cluster)
    assert 2 <= len(workers) <= 3, [w["metadata"]["name"] for w in workers]
    for worker in workers:
        container = worker["spec"]["containers"][0]
        assert container["image"] == main["image"]  # main's, not Argo's wait container's (listed first)
        assert worker["spec"]["serviceAccountName"] != cluster.service_account
        assert [r["uid"] for r in worker["metadata"]["ownerReferences"]] == [master.metadata.uid]
        wenv = {e["name"]: e for e in container["env"]}
        # The store by its endpoint; its keys by reference to the workers' own Secret, never KFP's whole-store one.
        assert wenv["AWS_ENDPOINT_URL"]["value"] == s3.endpoint
        assert wenv["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {"name": WORKER_STORE_SECRET, "key": "AWS_ACCESS_KEY_ID"}
        assert wenv["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {"name": WORKER_STORE_SECRET,
                                                                              "key": "AWS_SECRET_ACCESS_KEY"}
    with open(task.path(f"{JOB_DIR}/events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    assert [e for e in events if e["event"] == "died"] == []

    # The component's outputs, uploaded by the launcher under the run's root, and what it publishes.
    outputs = published(log)
    model = outputs["artifacts"]["model"]["metadata"]
    assert model["framework"] and model["mlflow_run_id"] and model["steps"] > 0, model
    metrics = outputs["artifacts"]["metrics"]["metadata"]
    assert metrics["accuracy"] >= 0.8 and metrics["relaunches"] == 0, metrics
    prefix = f"v2/artifacts/{driver.pipeline}/{RUN_ID}/train-elastic"
    assert s3.client().head_object(Bucket=BUCKET, Key=f"{prefix}/model/model.json")
    assert b"<html" in s3.client().get_object(Bucket=BUCKET, Key=f"{prefix}/report")["Body"].read().lower()

    assert job_objects(cluster) == []  # no pod, Secret or NetworkPolicy of the job is left
    assert cluster.refused() == set()
    used = cluster.used()
    assert {n for _, _, n in used} == {ns}
    # deploy/'s Role, and what KFP's launcher reads (kfp-launcher, the store Secret), which the
    # master's pre-flight reads too
    expected = role_rules() | {("get", "configmaps"), ("get", "secrets")}
    assert {(verb, resource) for verb, resource, _ in used} == expected, sorted(expected ^ {(v, r) for v, r, _ in used})
