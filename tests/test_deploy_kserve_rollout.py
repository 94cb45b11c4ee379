"""The `kserve` target's rollout, the deploy's own code (deploy_kserve and ServingCluster's Ready
wait) against KServe's controller as tests/kserve_fake.py plays it, with real model servers as
the revisions: a first deploy is rolled out and answers with the registered version's
predictions; a bad version's canary never becomes Ready, the traffic goes back to the rolled-out
revision (canaryTrafficPercent 0) and the deploy fails with KServe's reason; a good canary takes
all the traffic once Ready; a rollback rolls the version it replaced out again."""

from __future__ import annotations

import glob
import os

import httpx
import numpy as np
import pytest

from elastic_step.errors import JobFailed
from kserve_fake import FakeKServe
from registered_models import make_store, predict, register_linear, rows

pytestmark = pytest.mark.e2e
NAME = "kserve-rollout"


@pytest.fixture
def store(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = make_store(str(tmp_path / "registry"))
    versions = {"good": register_linear(uri, NAME, seed=1), "bad": register_linear(uri, NAME, seed=2),
                "better": register_linear(uri, NAME, seed=3)}
    folder = MlflowClient(uri).get_model_version_download_uri(NAME, versions["bad"]).removeprefix("file://")
    (weights,) = glob.glob(os.path.join(folder, "data", "model.pth"))
    with open(weights, "wb") as f:  # its server exits while loading: never Ready
        f.write(b"not a model")
    return {"uri": uri, **versions}


@pytest.fixture
def kserve(tmp_path, store):
    fake = FakeKServe("serving", str(tmp_path), store["uri"])
    yield fake
    fake.close()


def answers(address: str, data: np.ndarray) -> np.ndarray:
    reply = httpx.post(f"{address}/invocations", json={"inputs": data.tolist()}, timeout=30)
    assert reply.status_code == 200, reply.text
    return np.asarray(reply.json()["predictions"], dtype=np.float32)


def test_a_bad_canary_rolls_back_and_a_good_one_takes_all_the_traffic(store, kserve):
    from elastic_step.release.deploy_kserve import apply_kserve
    from elastic_step.release.deploy_render import DeploySettings
    from elastic_step.release.served_model import resolve

    settings = DeploySettings(namespace="serving", name="digits", service_account="model-server", storage_secret="model-store")
    data = rows(6)
    expected = {v: predict(store["uri"], f"models:/{NAME}/{store[v]}", data) for v in ("good", "better")}

    first = apply_kserve(kserve, NAME, resolve(NAME, store["good"], store["uri"]), settings, 120, store["uri"])
    assert (first.version, first.endpoint) == (store["good"], "http://digits.serving.example.com")
    assert "canaryTrafficPercent" not in kserve.objects["digits"]["spec"]["predictor"]  # nothing served before it
    np.testing.assert_allclose(answers(kserve.serving_address(), data), expected["good"], rtol=1e-5, atol=1e-6)

    # 40s: time for the bad revision's server to import and fail on its weights on a busy machine
    with pytest.raises(JobFailed, match=rf"^InferenceService 'digits' was not Ready within 40s: revision "
                                        rf"digits-predictor-00002 failed: its server exited with code 1; "
                                        rf"traffic stays on version {store['good']}$"):
        apply_kserve(kserve, NAME, resolve(NAME, store["bad"], store["uri"]), settings, 40, store["uri"])
    assert kserve.objects["digits"]["spec"]["predictor"]["canaryTrafficPercent"] == 0  # KServe: all to the rolled-out one
    np.testing.assert_allclose(answers(kserve.serving_address(), data), expected["good"], rtol=1e-5, atol=1e-6)

    better = apply_kserve(kserve, NAME, resolve(NAME, store["better"], store["uri"]), settings, 120, store["uri"])
    assert (better.version, better.previous_version) == (store["better"], store["good"])
    spec = kserve.objects["digits"]
    assert spec["spec"]["predictor"]["canaryTrafficPercent"] == 100
    assert spec["metadata"]["annotations"]["elastic-step.io/previous-version"] == store["good"]
    assert spec["status"]["components"]["predictor"]["latestRolledoutRevision"] == "digits-predictor-00003"
    np.testing.assert_allclose(answers(kserve.serving_address(), data), expected["better"], rtol=1e-5, atol=1e-6)

    # --rollback: the version it replaced, rolled out again (a canary, then all the traffic)
    back = apply_kserve(kserve, NAME, None, settings, 120, store["uri"])
    assert (back.version, back.previous_version) == (store["good"], store["better"])
    np.testing.assert_allclose(answers(kserve.serving_address(), data), expected["good"], rtol=1e-5, atol=1e-6)
