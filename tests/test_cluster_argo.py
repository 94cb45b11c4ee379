"""The Argo path on the cluster stand-in (tests/cluster): the train step's pod is made from the
shipped, rendered WorkflowTemplate the way Argo's controller makes it (an `init` container
fetching the input artifact, the `wait` container listed before `main`, main's command wrapped
by the executor, the workflow's service account), and the master in it trains on worker pods it
creates through the API. Workers share nothing with the master pod: not its image's first
container, not its files (the dataset artifact lives in the master pod only), not its token."""

from __future__ import annotations

import os
import time

import pytest
import yaml

from cluster import Cluster, role_rules, venv_image
from cluster.argo import ARGOEXEC_IMAGE, argoexec_image, step_pod
from cluster.rbac import REPO
from cluster.s3 import s3_server, upload
from conftest import SLOW_MODEL

pytestmark = pytest.mark.e2e

TEMPLATE = os.path.join(REPO, "pipelines", "argo", "training-workflowtemplate.yaml")
ARTIFACT_PATH = "/tmp/inputs/dataset"  # where Argo puts the train step's dataset artifact, in its pod only


@pytest.fixture
def cluster(tmp_path):
    import shutil

    from elastic_step.images import default_image

    layer = tmp_path / "image-layer"  # the project image, with the user's model definition added
    layer.mkdir()
    shutil.copy(SLOW_MODEL, layer / "slow_digits.py")
    project = venv_image(default_image(), extra_path=[str(layer)])
    images = {default_image(): project, ARGOEXEC_IMAGE: argoexec_image(str(tmp_path / "argoexec"))}
    with Cluster(str(tmp_path / "cluster"), images=images) as c:
        print(f"kubelet runtime: {c.kubelet.mode}")
        yield c


def test_the_argo_train_step_pod_trains_on_worker_pods_that_share_nothing_with_it(tmp_path, digits, cluster):
    with open(TEMPLATE) as f:
        document = yaml.safe_load(f)
    ns = cluster.namespace
    with s3_server() as endpoint:
        # What the prepare-data step left in the artifact repository (its credentials are not modelled: public-read).
        upload(endpoint, digits, "artifacts", "wf-1/prepare-data/dataset", public=True)
        inputs = {"model-def": "slow_digits", "workers": "2:3", "epochs": "2", "minibatch-size": "16",
                  "minibatches-per-task": "2", "checkpoint-steps": "0", "seed": "0", "backend": "kubernetes",
                  "experiment": "elastic-step"}
        pod = step_pod(document, "train", "wf-1", inputs, {"mlflow-uri": "sqlite:////tmp/mlflow.db"},
                       {"dataset": {"bucket": "artifacts", "key": "wf-1/prepare-data/dataset", "endpoint": endpoint}})
        assert [c["name"] for c in pod["spec"]["containers"]] == ["wait", "main"]
        api = cluster.core()
        api.create_namespaced_pod(ns, pod)
        name = pod["metadata"]["name"]
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            phase = api.read_namespaced_pod(name, ns).status.phase
            if phase in ("Succeeded", "Failed"):
                break
            time.sleep(0.5)
        log = api.read_namespaced_pod_log(name, ns)
        workers = [e[4] for e in cluster.server.store.history if e[1] == "pods" and e[3] == "ADDED"
                   and e[4]["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "worker"]
        master = api.read_namespaced_pod(name, ns)
        # The workers run main's image (not the executor's, listed first), as their own account, owned by the step's pod.
        assert workers, log
        for worker in workers:
            assert worker["spec"]["containers"][0]["image"] == pod["spec"]["containers"][1]["image"]
            assert worker["spec"]["serviceAccountName"] != document["spec"]["serviceAccountName"]
            assert [r["uid"] for r in worker["metadata"]["ownerReferences"]] == [master.metadata.uid]
        worker_logs = {name: [line for line in text.decode(errors="replace").splitlines() if "error" in line.lower()][-2:]
                       for (_, name), text in cluster.kubelet.past_logs.items() if name != pod["metadata"]["name"]}
        if phase == "Failed" and worker_logs and all(
                any(f"manifest not found: {ARTIFACT_PATH}/manifest.json" in line for line in lines) for lines in worker_logs.values()):
            # Known defect (issue 14, first item): the train template hands workers the dataset
            # artifact's path inside the master's pod; no worker pod can read it. This test passes
            # once workers get a store URI instead; any other failure fails it.
            pytest.xfail(f"workers were given the master pod's own path {ARTIFACT_PATH} (issue 14)")
        assert phase == "Succeeded", f"{log}\nworker logs: {worker_logs}"
    assert "argoexec wait: main exited with 0" in log
    instance = workers[0]["metadata"]["labels"]["app.kubernetes.io/instance"]
    left = [o["metadata"]["name"] for plural in ("pods", "secrets", "networkpolicies") for o in cluster.objects(plural)
            if o["metadata"].get("labels", {}).get("app.kubernetes.io/instance") == instance]
    assert left == []
    assert cluster.refused() == set()
    assert {(verb, resource) for verb, resource, _ in cluster.used()} == role_rules()
