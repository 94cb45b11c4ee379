"""The `mlflow` target's server pod, as `deploy` renders it, run by the cluster stand-in's kubelet
(tests/cluster): its command, environment, security context and probes as rendered, the model
fetched from a real MLflow server. A request to the pod's address returns the predictions of the
registered version loaded in the test.

Played here, not by the stand-in: the ReplicaSet controller. The stand-in serves no Deployments,
so the test creates the one pod the Deployment's template describes (with restartPolicy Never,
the only one the kubelet stand-in runs), as the controller would."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
from kubernetes import client as k8s

from cluster import Cluster
from mlflow_server import MlflowServer, free_port
from registered_models import predict, register_linear, rows

pytestmark = pytest.mark.e2e
NAME = "pod-served"


@pytest.fixture
def mlflow_server(tmp_path):
    server = MlflowServer(str(tmp_path / "mlflow"))
    server.start()
    yield server
    server.stop()


def test_the_mlflow_targets_pod_serves_the_registered_versions_predictions(mlflow_server, tmp_path):
    from elastic_step.release.deploy_render import DeploySettings, Track, model_deployment
    from elastic_step.release.served_model import resolve

    version = register_linear(mlflow_server.uri, NAME, seed=5)
    model = resolve(NAME, version, mlflow_server.uri)
    with Cluster(str(tmp_path / "cluster")) as cluster:
        print(f"kubelet runtime: {cluster.kubelet.mode}")
        port = free_port()
        settings = DeploySettings(namespace=cluster.namespace, name="digits", service_account="model-server",
                                  storage_secret="model-store", mlflow_uri=mlflow_server.uri, image=cluster.project_image,
                                  port=port)
        api = cluster.core()
        api.create_namespaced_service_account(cluster.namespace, k8s.V1ServiceAccount(metadata=k8s.V1ObjectMeta(name="model-server")))
        api.create_namespaced_secret(cluster.namespace, k8s.V1Secret(metadata=k8s.V1ObjectMeta(name="model-store"),
                                                                     string_data={"MLFLOW_TRACKING_TOKEN": "unused"}))
        template = model_deployment(model, settings, Track.STABLE)["spec"]["template"]
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "digits-stable-1", **template["metadata"]},
               "spec": {**template["spec"], "restartPolicy": "Never"}}
        api.create_namespaced_pod(cluster.namespace, pod)
        url = f"http://{pod_ip(api, cluster.namespace, 'digits-stable-1')}:{port}"
        wait_ready(api, cluster, url)
        data = rows(8, seed=11)
        answer = httpx.post(f"{url}/invocations", json={"inputs": data.tolist()}, timeout=30)
        assert answer.status_code == 200, answer.text
        served = np.asarray(answer.json()["predictions"], dtype=np.float32)
        np.testing.assert_allclose(served, predict(mlflow_server.uri, f"models:/{NAME}/{version}", data), rtol=1e-5, atol=1e-6)


def pod_ip(api, namespace: str, name: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = api.read_namespaced_pod(name, namespace).status
        if status and status.pod_ip and status.phase == "Running":
            return status.pod_ip
        assert status is None or status.phase not in ("Failed", "Succeeded"), status
        time.sleep(0.2)
    raise AssertionError(f"pod {name} not running in {timeout}s")


def wait_ready(api, cluster, url: str, timeout: float = 120.0) -> None:
    """The readiness probe's request, as the kubelet would make it (the stand-in runs no probes)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ping", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        phase = api.read_namespaced_pod("digits-stable-1", cluster.namespace).status.phase
        assert phase == "Running", f"the server pod ended ({phase}): {cluster.kubelet.read_log(cluster.namespace, 'digits-stable-1')[-3000:]!r}"
        time.sleep(0.5)
    raise AssertionError(f"{url}/ping did not answer in {timeout}s")
