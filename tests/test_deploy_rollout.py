"""The mlflow target's rollout, the deploy's own code (elastic_step.release.deploy_mlflow) over the
cluster seam of tests/serving_fake.py, whose pods are real `mlflow models serve` processes of the
rendered containers: a first deploy serves the registered version's predictions; a bad version
(a server that never answers /ping) is deleted after the timeout, the deploy fails with the
reason, and the previous version still serves; a rollback with no previous revision is refused."""

from __future__ import annotations

import glob
import os

import httpx
import numpy as np
import pytest

from elastic_step.errors import ConfigError, JobFailed
from registered_models import make_store, predict, register_linear, rows
from serving_fake import FakeServingCluster

pytestmark = pytest.mark.e2e
NAME = "rollout"


@pytest.fixture
def store(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = make_store(str(tmp_path / "registry"))
    good = register_linear(uri, NAME, seed=1)
    bad = register_linear(uri, NAME, seed=2)
    better = register_linear(uri, NAME, seed=3)
    # the bad version's weights file is not a model: its server exits while loading, never Ready
    folder = MlflowClient(uri).get_model_version_download_uri(NAME, bad).removeprefix("file://")
    (weights,) = glob.glob(os.path.join(folder, "data", "model.pth"))
    with open(weights, "wb") as f:
        f.write(b"not a model")
    return {"uri": uri, "good": good, "bad": bad, "better": better}


@pytest.fixture
def cluster(tmp_path):
    fake = FakeServingCluster("serving", str(tmp_path))
    yield fake
    fake.close()


def settings(store):
    from elastic_step.release.deploy_render import DeploySettings

    return DeploySettings(namespace="serving", name="digits", service_account="model-server", storage_secret="model-store",
                          mlflow_uri=store["uri"], image="elastic-step")


def answers(address: str, data: np.ndarray) -> np.ndarray:
    reply = httpx.post(f"{address}/invocations", json={"inputs": data.tolist()}, timeout=30)
    assert reply.status_code == 200, reply.text
    return np.asarray(reply.json()["predictions"], dtype=np.float32)


def test_a_bad_version_is_rolled_back_and_the_previous_one_keeps_serving(store, cluster):
    from elastic_step.release.deploy_mlflow import apply_mlflow
    from elastic_step.release.served_model import resolve

    good = resolve(NAME, store["good"], store["uri"])
    result = apply_mlflow(cluster, NAME, good, settings(store), timeout=120, mlflow_uri=store["uri"])
    assert (result.version, result.previous_version, result.applied) == (store["good"], "", True)
    data = rows(6)
    expected = predict(store["uri"], f"models:/{NAME}/{store['good']}", data)
    stable = cluster.address("digits-stable")
    np.testing.assert_allclose(answers(stable, data), expected, rtol=1e-5, atol=1e-6)

    bad = resolve(NAME, store["bad"], store["uri"])  # its MLmodel and signature are fine
    # 40s: time for its server to import and reach the weights on a busy machine, and fail there
    with pytest.raises(JobFailed, match=rf"Deployment digits-canary was not Ready within 40s .*; traffic stays on version {store['good']}$"):
        apply_mlflow(cluster, NAME, bad, settings(store), timeout=40, mlflow_uri=store["uri"])
    assert cluster.calls[-2:] == [("write", "Deployment/digits-canary"), ("delete", "Deployment/digits-canary")]
    assert sorted(cluster.objects) == [("Deployment", "digits-stable"), ("Service", "digits")]
    assert cluster.served_version("digits") == (store["good"], "")
    assert cluster.objects[("Service", "digits")]["metadata"]["labels"]["elastic-step.io/model-version"] == store["good"]
    np.testing.assert_allclose(answers(stable, data), expected, rtol=1e-5, atol=1e-6)  # still serving, same answers
    # it failed for the reason the test made: its server could not load the weights
    assert b"UnpicklingError" in open(os.path.join(cluster.folder, "digits-canary.log"), "rb").read()

    # and nothing was replaced, so there is nothing to roll back to
    with pytest.raises(ConfigError, match="serving/digits has no previous revision to roll back to"):
        apply_mlflow(cluster, NAME, None, settings(store), timeout=20, mlflow_uri=store["uri"])


def test_a_canary_takes_over_once_ready_and_a_rollback_returns_to_the_version_it_replaced(store, cluster):
    from elastic_step.release.deploy_mlflow import apply_mlflow
    from elastic_step.release.served_model import resolve

    data = rows(6)
    expected = {v: predict(store["uri"], f"models:/{NAME}/{store[v]}", data) for v in ("good", "better")}
    apply_mlflow(cluster, NAME, resolve(NAME, store["good"], store["uri"]), settings(store), timeout=120, mlflow_uri=store["uri"])
    result = apply_mlflow(cluster, NAME, resolve(NAME, store["better"], store["uri"]), settings(store), timeout=120,
                          mlflow_uri=store["uri"])
    assert (result.version, result.previous_version) == (store["better"], store["good"])
    # the canary was written and Ready before stable changed, and went once stable served the new version
    assert cluster.calls[-4:] == [("write", "Deployment/digits-canary"), ("write", "Deployment/digits-stable"),
                                  ("write", "Service/digits"), ("delete", "Deployment/digits-canary")]
    assert cluster.served_version("digits") == (store["better"], store["good"])
    np.testing.assert_allclose(answers(cluster.address("digits-stable"), data), expected["better"], rtol=1e-5, atol=1e-6)

    back = apply_mlflow(cluster, NAME, None, settings(store), timeout=120, mlflow_uri=store["uri"])
    assert (back.version, back.previous_version) == (store["good"], store["better"])
    assert cluster.served_version("digits") == (store["good"], store["better"])  # a second rollback undoes the first
    np.testing.assert_allclose(answers(cluster.address("digits-stable"), data), expected["good"], rtol=1e-5, atol=1e-6)
