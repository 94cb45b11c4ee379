"""A master in a pod names its instance after its pod's UID, which deploy/rbac's admission policy
holds the pod's token to (tests/test_admission_policy.py plays the policy): so two masters never
share an instance, and a second master in the same pod, finding the first's objects, says how to
delete them instead of blaming the Role. Unit-level, on the fake API (tests/kube_fake.py)."""

from __future__ import annotations

import pytest

from elastic_step.backends.api import LaunchSpec
from elastic_step.backends.kubernetes.backend import KubernetesBackend
from elastic_step.backends.kubernetes.manifests import JobNames
from elastic_step.backends.kubernetes.options import MasterPod, PodSettings
from elastic_step.errors import ConfigError
from kube_fake import FakeCoreV1Api

UID = "3f2a9c0e-5b1d-4c6e-8f00-123456789abc"


def test_a_master_pods_instance_ends_with_its_uid_and_elsewhere_it_is_random():
    in_pod = MasterPod(name="train-step", uid=UID, ip="10.0.0.5", namespace="ml")
    assert JobNames.for_master("digits", in_pod, "ml").instance == "digits-3f2a9c"
    # Workers in another namespace, a master outside a pod or with no known UID: random, as before.
    others = [JobNames.for_master("digits", in_pod, "other"), JobNames.for_master("digits", None, "ml"),
              JobNames.for_master("digits", MasterPod(name="m", uid="", ip="", namespace="ml"), "ml")]
    assert all(n.instance.startswith("digits-") and n.instance != "digits-3f2a9c" for n in others)
    assert len({n.instance for n in others}) == 3


@pytest.fixture
def fake(tmp_path):
    api = FakeCoreV1Api(str(tmp_path / "cluster"))
    yield api
    api.close()


def test_a_second_master_in_the_same_pod_names_the_objects_left_and_how_to_delete_them(tmp_path, fake, monkeypatch):
    pod = fake.add_master_pod("train-step-1", "registry.example/ml/es:2.0", namespace="ml")
    for name in ("ELASTIC_STEP_IMAGE", "ELASTIC_STEP_POD_NAME", "KFP_POD_NAME"):
        monkeypatch.delenv(name, raising=False)
    token = tmp_path / "token"
    token.write_text("s3cret")
    master = MasterPod("train-step-1", pod.metadata.uid, "127.0.0.1", "ml")

    def start() -> KubernetesBackend:
        return KubernetesBackend(LaunchSpec("http://127.0.0.1:9", str(token), str(tmp_path), {}),
                                 PodSettings(namespace="ml", image=None), "unit", api=fake, master=master, watch_timeout_s=1)

    first = start()  # killed outright: its objects stay, owned by the pod that is still there
    assert first.names.instance == f"unit-{pod.metadata.uid[:6]}"
    made = (set(fake.secrets), set(fake.network_policies))
    with pytest.raises(ConfigError) as caught:
        start()
    message = str(caught.value)
    assert f"{first.names.secret} is already in namespace ml" in message and "\n" not in message
    assert f"kubectl delete pods,secrets,networkpolicies,configmaps -n ml -l app.kubernetes.io/instance={first.names.instance}" \
        in message
    assert (set(fake.secrets), set(fake.network_policies)) == made  # nothing more made, nothing of the first deleted
    first.shutdown(grace_s=0)
