"""The KFP path on the cluster stand-in (tests/cluster): the `train-elastic` task's pod is made
from the COMPILED `pipelines/compiled/training_pipeline.yaml` with `backend=kubernetes`
(tests/cluster/kfp.py): the executor's image, command and args from its deploymentSpec, the
`kfp-kubernetes` config from the platform spec (the downward-API env the master needs, the pod
labels, the store's keys from KFP's own `mlpipeline-minio-artifact` Secret), and the executor
input KFP's launcher hands the component, in which the `dataset` is the `s3://` URI of
prepare-data's output in an S3 artifact store (moto, a private bucket) and the outputs are the
SDK's local paths under the pod's /s3 scratch volume. What a platform engineer adds to the task,
as the component's docstring says: the store endpoint as env (`set_env_variable`). The master in it trains on worker pods it creates through the API with
the pod's own service account (deploy/'s Role); the workers read the data from the store.

Not modelled: KFP's driver and launcher binaries (the executor input is made here as the driver
and launcher would make it; input artifacts are not downloaded, outputs not uploaded, no MLMD,
no cache), the Workflow object and KFP's API server; the other tasks of the pipeline (the
prepared data is put where prepare-data would leave it)."""

from __future__ import annotations

import json
import os
import time

import pytest
from kubernetes import client as k8s

from cluster import Cluster, role_rules, venv_image
from cluster.argo import ARGOEXEC_IMAGE, argoexec_image
from cluster.kfp import OUTPUT_FILE, local_path, task_pod
from elastic_step.audit import audit_report
from stores import REGION, S3Server
from test_cluster_argo import JOB_DIR, StepOnNode, job_objects, worker_pods_made

pytestmark = pytest.mark.e2e

RUN_ID = "5f0c1d2e-3b4a-4c5d-8e9f-0a1b2c3d4e5f"
ARTIFACTS = "s3://mlpipeline/v2/artifacts"  # the pipeline root: KFP's artifact store is S3 (or MinIO)
DATASET_KEY = f"v2/artifacts/elastic-step-training/{RUN_ID}/prepare-data/dataset"
STORE_SECRET = "mlpipeline-minio-artifact"  # KFP's own, keys accesskey / secretkey
WORKER_STORE_SECRET = "elastic-step-data-reader"  # what worker pods read the data with where the task's keys are KFP's
PARAMETERS = {"backend": "kubernetes", "workers": "2:3", "epochs": 2, "minibatch_size": 16, "minibatches_per_task": 2,
              "checkpoint_steps": 0, "mlflow_uri": "sqlite:////tmp/mlflow.db", "job_dir": JOB_DIR}


@pytest.fixture
def cluster(tmp_path):
    from elastic_step.images import default_image

    images = {default_image(): venv_image(default_image()), ARGOEXEC_IMAGE: argoexec_image(str(tmp_path / "argoexec"))}
    with Cluster(str(tmp_path / "cluster"), images=images) as c:
        print(f"kubelet runtime: {c.kubelet.mode}")
        yield c


@pytest.fixture
def s3():
    with S3Server() as server:
        yield server


def test_the_compiled_kfp_train_task_trains_on_worker_pods_that_read_the_dataset_uri_from_the_store(digits, s3, cluster):
    if cluster.kubelet.isolation not in ("namespaces", "docker"):
        pytest.fail(f"this test needs a container's own filesystem (runtime: {cluster.kubelet.mode})")
    ns = cluster.namespace
    api = cluster.core()
    dataset_uri = s3.upload(digits, "mlpipeline", DATASET_KEY)  # private: a reader needs the Secret's keys
    api.create_namespaced_secret(ns, k8s.V1Secret(metadata=k8s.V1ObjectMeta(name=STORE_SECRET), string_data={
        "accesskey": "AKIDKFPTEST", "secretkey": "not-a-real-secret"}))
    # The workers' own (docs/kubernetes.md: read-only keys for the dataset; the stand-in store has one user).
    api.create_namespaced_secret(ns, k8s.V1Secret(metadata=k8s.V1ObjectMeta(name=WORKER_STORE_SECRET), string_data={
        "AWS_ACCESS_KEY_ID": "AKIDKFPTEST", "AWS_SECRET_ACCESS_KEY": "not-a-real-secret"}))
    pod, executor = task_pod("train-elastic", RUN_ID, PARAMETERS, {"dataset": dataset_uri}, ARTIFACTS,
                             cluster.service_account, env={"AWS_ENDPOINT_URL": s3.endpoint, "AWS_REGION": REGION})
    main = pod["spec"]["containers"][-1]
    assert [c["name"] for c in pod["spec"]["containers"]] == ["wait", "main"]
    assert main["image"] == cluster.project_image and "kfp.dsl.executor_main" in main["command"][-2]
    assert main["args"][-4:] == ["--executor_input", json.dumps(executor), "--function_to_execute", "train_elastic"]
    env = {e["name"]: e for e in main["env"]}
    assert env["ELASTIC_STEP_POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"  # from the platform spec
    # the store's keys too: the compiled pipeline takes them from KFP's own MinIO Secret
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {"name": STORE_SECRET, "key": "accesskey", "optional": True}
    assert executor["inputs"]["parameterValues"]["pipeline_run_id"] == RUN_ID
    assert pod["metadata"]["labels"]["app.kubernetes.io/part-of"] == "elastic-step"
    api.create_namespaced_pod(ns, pod)
    name = pod["metadata"]["name"]
    task = StepOnNode(cluster, name)

    started = time.monotonic()
    phase = task.wait_ended(150)
    log = task.log()
    worker_logs = {n: [line for line in text.decode(errors="replace").splitlines() if "error" in line.lower()][-2:]
                   for (_, n), text in cluster.kubelet.past_logs.items() if n != name}
    assert phase == "Succeeded", f"{log}\nworker logs: {worker_logs}"
    assert "argoexec wait: main exited with 0" in log
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

    # The component's outputs: the executor output file and the model under the SDK's local path.
    with open(task.path(OUTPUT_FILE)) as f:
        outputs = json.load(f)["artifacts"]
    model = outputs["model"]["artifacts"][0]["metadata"]
    assert model["framework"] and model["mlflow_run_id"] and model["steps"] > 0, model
    metrics = outputs["metrics"]["artifacts"][0]["metadata"]
    assert metrics["accuracy"] >= 0.8 and metrics["relaunches"] == 0, metrics
    scratch = cluster.kubelet.volume_path(ns, name, "s3-scratch")
    model_uri = executor["outputs"]["artifacts"]["model"]["artifacts"][0]["uri"]
    report_uri = executor["outputs"]["artifacts"]["report"]["artifacts"][0]["uri"]
    assert os.path.isfile(os.path.join(scratch, os.path.relpath(local_path(model_uri), "/s3"), "model.json"))
    with open(os.path.join(scratch, os.path.relpath(local_path(report_uri), "/s3"))) as f:
        assert "<html" in f.read().lower()

    assert job_objects(cluster) == []  # no pod, Secret or NetworkPolicy of the job is left
    assert cluster.refused() == set()
    used = cluster.used()
    assert {n for _, _, n in used} == {ns}
    # deploy/'s Role, and the master's pre-flight reads of what KFP's launcher reads (kfp-launcher, the store Secret)
    expected = role_rules() | {("get", "configmaps"), ("get", "secrets")}
    assert {(verb, resource) for verb, resource, _ in used} == expected, sorted(expected ^ {(v, r) for v, r, _ in used})
