"""`deploy` on the cluster stand-in with its Deployments, ReplicaSets, Services and readiness
probes (tests/cluster/apps.py) and KServe's controller as it plays it (tests/cluster/kserve.py):
real `mlflow models serve` pods of the registered versions, fetched from a real MLflow server
through the pod network, each pod on an address of its own, every request made through the
Service or the InferenceService's route, as a client of the cluster makes it.

The tests of this module run in order on one cluster: a first deploy serves, a canary shifts the
traffic, a bad version rolls back, a rollback returns to the replaced version; then the same for
the kserve target. Every pod of the mlflow target (the first deploy, the canary, the bad version,
the rollback) is a Docker container of the project's image (the one `make image-smoke` builds), as
a real cluster runs it; KServe's MLflow runtime, as the stand-in's controller plays it, runs the
same code from this machine's environment on the process runtime (PROCESS_IMAGE), beside them on
the same pod network."""

from __future__ import annotations

import glob
import ipaddress
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx
import numpy as np
import pytest
from kubernetes import client as k8s
from mlflow.tracking import MlflowClient

from cluster import Cluster, Image, venv_image
from elastic_step.errors import JobFailed
from cluster.apps import start_apps
from cluster.kserve import install_kserve
from cluster.network import available
from mlflow_server import MlflowServer
from registered_models import predict, register_linear, rows
from test_cluster_e2e import docker_daemon  # noqa: F401 (a fixture: the daemon holding make image-smoke's image)

pytestmark = pytest.mark.e2e
NAME = "cluster-deploy"
DATA = rows(6, seed=3)
PROCESS_IMAGE = "registry.example/ml/elastic-step-venv:test"  # the project as this machine's venv: process runtime


@dataclass
class World:
    cluster: Cluster
    apps: object
    server: MlflowServer
    pod_mlflow: str  # the registry as pods reach it
    versions: dict[str, str]
    expected: dict[str, np.ndarray]  # version -> its predictions of DATA, loaded in the test
    folder: str

    def settings(self, name: str, image: str = PROCESS_IMAGE):
        from elastic_step.release.deploy_render import DeploySettings

        return DeploySettings(namespace=self.cluster.namespace, name=name, service_account="model-server",
                              storage_secret="model-store", mlflow_uri=self.pod_mlflow, image=image)

    def deploy(self, name: str, target: str, timeout: float = 120, image: str | None = None, **kwargs):
        # The mlflow target's pods: containers of elastic-step deploy's default image (Docker).
        image = image or (self.cluster.project_image if target == "mlflow" else PROCESS_IMAGE)
        from elastic_step.release.deploy import deploy_model

        return deploy_model(registered_model=NAME, settings=self.settings(name, image), target=target, timeout=timeout,
                            mlflow_uri=self.server.uri, api_client=k8s.ApiClient(self.cluster.configuration()), **kwargs)

    def which(self, answer: np.ndarray) -> str:
        """The version whose predictions `answer` is."""
        return next(v for v, e in self.expected.items() if np.allclose(answer, e, rtol=1e-5, atol=1e-6))


@pytest.fixture(scope="module")
def world(tmp_path_factory, docker_daemon):  # noqa: F811
    from elastic_step.images import default_image

    if not available():
        pytest.fail("this node cannot make network namespaces (needs root, iproute2 and unshare --net)")
    root = str(tmp_path_factory.mktemp("cluster-deploy"))
    images = {default_image(): Image(default_image(), {}, docker=default_image()), PROCESS_IMAGE: venv_image(PROCESS_IMAGE)}
    with Cluster(os.path.join(root, "cluster"), images=images, docker=docker_daemon, docker_by_image=True,
                 pod_network=True) as cluster:
        print(f"kubelet runtime: {cluster.kubelet.mode}")
        server = MlflowServer(os.path.join(root, "mlflow"))
        os.makedirs(server.root, exist_ok=True)
        gateway = f"{cluster.network.gateway}:{server.port}"
        server.allowed_hosts = [gateway, f"127.0.0.1:{server.port}", f"localhost:{server.port}"]
        server.start(timeout=300)  # a loaded 2-core machine: minutes
        apps = start_apps(cluster)
        kserve = install_kserve(cluster, apps, PROCESS_IMAGE)
        try:
            versions = {"good": register_linear(server.uri, NAME, seed=1), "bad": register_linear(server.uri, NAME, seed=2),
                        "better": register_linear(server.uri, NAME, seed=3)}
            spoil(server, versions["bad"])
            expected = {versions[k]: predict(server.uri, f"models:/{NAME}/{versions[k]}", DATA) for k in ("good", "better")}
            pod_mlflow = cluster.pod_url(server.uri)
            serving_account(cluster, pod_mlflow)
            yield World(cluster, apps, server, pod_mlflow, versions, expected, root)
        finally:
            kserve.close()
            apps.close()
            server.stop()


def spoil(server: MlflowServer, version: str) -> None:
    """The version's weights file is not a model: its server exits while loading, never Ready
    (its MLmodel and signature are fine, so deploy accepts it)."""
    location = MlflowClient(server.uri).get_model_version_download_uri(NAME, version)
    folder = os.path.join(server.artifacts, location.split(":", 1)[1].lstrip("/"))
    (weights,) = glob.glob(os.path.join(folder, "**", "model.pth"), recursive=True)
    with open(weights, "wb") as f:
        f.write(b"not a model")


def serving_account(cluster, pod_mlflow: str) -> None:
    """The server pods' account and the Secret it lists (KServe's storage initializer reads it)."""
    api = cluster.core()
    api.create_namespaced_secret(cluster.namespace, k8s.V1Secret(metadata=k8s.V1ObjectMeta(name="model-store"),
                                                                 string_data={"MLFLOW_TRACKING_URI": pod_mlflow}))
    api.create_namespaced_service_account(cluster.namespace, k8s.V1ServiceAccount(
        metadata=k8s.V1ObjectMeta(name="model-server"), secrets=[k8s.V1ObjectReference(name="model-store")]))


def answer(url: str, patience_s: float = 30.0) -> np.ndarray:
    """The predictions through the Service. A connection the Service closes unanswered (no Ready
    endpoint at that moment: a probe of a busy node's server timed out) is tried again, as a
    client of a Service would; which version answers is still each caller's assertion."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            reply = httpx.post(f"{url}/invocations", json={"inputs": DATA.tolist()}, timeout=30)
            break
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    assert reply.status_code == 200, reply.text
    return np.asarray(reply.json()["predictions"], dtype=np.float32)


def test_the_mlflow_target_serves_the_registered_versions_predictions_through_its_service(world, docker_daemon):  # noqa: F811
    good, image = world.versions["good"], world.cluster.project_image
    result = world.deploy("digits", "mlflow", version=good, image=image)  # elastic-step deploy's default image
    assert (result.version, result.previous_version, result.applied) == (good, "", True)
    url = world.apps.service_url(world.cluster.namespace, "digits")
    np.testing.assert_allclose(answer(url), world.expected[good], rtol=1e-5, atol=1e-6)
    (pod,) = world.cluster.pods(selector="app.kubernetes.io/instance=digits")
    # The server is a container of the built image, on its pod's own address in the pod network,
    # which the Service's request reached (the server listens on that address alone: -h $(POD_IP)).
    container = world.cluster.kubelet.record(world.cluster.namespace, pod["metadata"]["name"]).containers[0].proc.container
    inspect = subprocess.run(["docker", "inspect", "-f", "{{.Config.Image}} {{.State.Running}}", container], env=docker_daemon.env,
                             capture_output=True, text=True)
    assert inspect.stdout.split() == [image, "true"], inspect.stdout + inspect.stderr
    assert ipaddress.ip_address(pod["status"]["podIP"]) in ipaddress.ip_network("10.244.0.0/16"), pod["status"]
    assert pod["spec"]["containers"][0]["command"][-4:] == ["-h", "$(POD_IP)", "-p", "8080"]
    labels = pod["metadata"]["labels"]
    run = MlflowClient(world.server.uri).get_model_version(NAME, good).run_id
    assert (labels["elastic-step.io/registered-model"], labels["elastic-step.io/model-version"],
            labels["elastic-step.io/mlflow-run"]) == (NAME, good, run)
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True  # the pod as rendered, admitted by the API


def test_a_canary_shares_the_traffic_and_then_takes_it_all(world):
    good, better = world.versions["good"], world.versions["better"]
    url = world.apps.service_url(world.cluster.namespace, "digits")
    seen: list[tuple[float, str]] = []
    done = threading.Event()

    def ask():
        while not done.is_set():
            try:
                seen.append((time.monotonic(), world.which(answer(url, patience_s=0))))
            except (httpx.HTTPError, AssertionError):
                pass  # a pod going away mid-request
            time.sleep(0.2)

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    try:
        result = world.deploy("digits", "mlflow", version=better)
        finished = time.monotonic()
    finally:
        done.set()
        asker.join()
    assert (result.version, result.previous_version) == (better, good)
    # Stable's and the canary's pods alike are containers of the project's image (the Docker runtime).
    images = {pod["spec"]["containers"][0]["image"] for pod in world.cluster.pods(selector="app.kubernetes.io/instance=digits")}
    assert images == {world.cluster.project_image}, images
    versions = [v for _, v in seen]
    assert versions[0] == good, versions
    # while the canary was Ready beside stable, requests in turn reached both
    assert any(a != b for a, b in zip(versions, versions[1:])) and good in versions and better in versions, versions
    assert all(v == better for t, v in seen if t > finished + 1), versions
    assert {world.which(answer(url)) for _ in range(4)} == {better}
    assert [d["metadata"]["name"] for d in world.cluster.objects("deployments")] == ["digits-stable"]


def test_a_bad_version_rolls_back_and_the_cli_exits_non_zero_with_the_reason(world, tmp_path):
    better, bad = world.versions["better"], world.versions["bad"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "MLFLOW_"))}
    kubeconfig = world.cluster.kubeconfig(tmp_path, "admin", world.cluster.admin_token)
    # The bad server exits while loading its model: the deploy rolls back then, long before its --timeout.
    done = subprocess.run([sys.executable, "-m", "elastic_step.cli", "deploy", "--registered-model", NAME, "--version", bad,
                           "--target", "mlflow", "--name", "digits", "--namespace", world.cluster.namespace,
                           "--service-account", "model-server", "--storage-secret", "model-store", "--timeout", "600",
                           "--image", world.cluster.project_image, "--mlflow-uri", world.server.uri,
                           "--serving-mlflow-uri", world.pod_mlflow],
                          capture_output=True, text=True, env={**env, "KUBECONFIG": kubeconfig}, timeout=240)
    assert done.returncode == 1, done.stderr
    assert re.fullmatch(r"elastic-step deploy: error: Deployment digits-canary failed its rollout \(1/1 replicas updated, 0 "
                        r"available\): pod digits-canary-[0-9a-f]+-[0-9a-z]+: container model-server exited with code 1 "
                        rf"\(Error(, CrashLoopBackOff)?\); traffic stays on version {better}", done.stderr.strip().splitlines()[-1]), done.stderr
    url = world.apps.service_url(world.cluster.namespace, "digits")
    assert {world.which(answer(url)) for _ in range(4)} == {better}
    assert [d["metadata"]["name"] for d in world.cluster.objects("deployments")] == ["digits-stable"]


def test_a_rollback_returns_stable_to_the_version_it_replaced(world):
    good, better = world.versions["good"], world.versions["better"]
    back = world.deploy("digits", "mlflow", rollback=True)
    assert (back.version, back.previous_version) == (good, better)
    url = world.apps.service_url(world.cluster.namespace, "digits")
    assert {world.which(answer(url)) for _ in range(4)} == {good}


def test_the_kserve_target_through_kserves_controller_rolls_a_canary_out(world):
    good, better = world.versions["good"], world.versions["better"]
    first = world.deploy("kdigits", "kserve", version=good)
    isvc = world.cluster.server.get("inferenceservices", world.cluster.namespace, "kdigits")
    assert first.endpoint == isvc["status"]["url"]
    np.testing.assert_allclose(answer(first.endpoint), world.expected[good], rtol=1e-5, atol=1e-6)
    assert isvc["status"]["components"]["predictor"]["latestRolledoutRevision"] == "kdigits-predictor-00001"

    second = world.deploy("kdigits", "kserve", version=better)
    assert (second.version, second.previous_version) == (better, good)
    isvc = world.cluster.server.get("inferenceservices", world.cluster.namespace, "kdigits")
    predictor = isvc["status"]["components"]["predictor"]
    assert (predictor["latestRolledoutRevision"], predictor["previousRolledoutRevision"]) == (
        "kdigits-predictor-00002", "kdigits-predictor-00001")
    assert isvc["spec"]["predictor"]["canaryTrafficPercent"] == 100  # the canary, once Ready, took all the traffic
    assert {world.which(answer(second.endpoint)) for _ in range(4)} == {better}


def test_a_bad_kserve_canary_sends_the_traffic_back_and_a_rollback_rolls_the_replaced_version_out(world):
    good, bad, better = world.versions["good"], world.versions["bad"], world.versions["better"]
    # KServe reports the revision failed once its server exited: the deploy rolls back then, not at its timeout.
    with pytest.raises(JobFailed, match=r"^InferenceService 'kdigits' failed its rollout: Revision "
                                        r'"kdigits-predictor-00003" failed with message: container kserve-container '
                                        rf"exited with code 1\.; traffic stays on version {better}$"):
        world.deploy("kdigits", "kserve", version=bad, timeout=600)
    isvc = world.cluster.server.get("inferenceservices", world.cluster.namespace, "kdigits")
    assert isvc["spec"]["predictor"]["canaryTrafficPercent"] == 0  # KServe: all to the last rolled-out revision
    assert isvc["status"]["components"]["predictor"]["traffic"] == [
        {"revisionName": "kdigits-predictor-00002", "percent": 100, "latestRevision": False}]
    assert {world.which(answer(isvc["status"]["url"])) for _ in range(4)} == {better}

    back = world.deploy("kdigits", "kserve", rollback=True)
    assert (back.version, back.previous_version) == (good, better)
    assert {world.which(answer(back.endpoint)) for _ in range(4)} == {good}


def test_a_kserve_write_goes_again_over_a_status_write_but_not_over_another_spec():
    """KServe's controller writes the InferenceService's status between deploy's read and its
    replace (409, the same generation): the replace is made again with the new resourceVersion.
    A spec someone else changed meanwhile (a new generation) stays the conflict it is."""
    from unittest import mock

    from kubernetes.client.rest import ApiException

    from elastic_step.release.deploy_apply import ServingCluster

    def isvc(version: str, generation: int) -> dict:
        return {"metadata": {"name": "kdigits", "resourceVersion": version, "generation": generation}, "spec": {}}

    serving = ServingCluster(k8s.ApiClient(), "ml")
    serving.custom = mock.Mock()
    serving.custom.replace_namespaced_custom_object.side_effect = [ApiException(status=409), {"written": True}]
    serving.custom.get_namespaced_custom_object.return_value = isvc("8", 2)
    assert serving.write_inference_service(isvc("", 2), isvc("7", 2)) == {"written": True}
    assert [c.args[-1]["metadata"]["resourceVersion"] for c in serving.custom.replace_namespaced_custom_object.call_args_list] == ["7", "8"]

    serving.custom.replace_namespaced_custom_object.side_effect = [ApiException(status=409)]
    serving.custom.get_namespaced_custom_object.return_value = isvc("9", 3)
    with pytest.raises(ApiException):
        serving.write_inference_service(isvc("", 2), isvc("7", 2))
