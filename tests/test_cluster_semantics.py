"""The API semantics of the cluster stand-in that the backends, `elastic-step submit` and the
preemption tests rely on, each as the real Kubernetes behaves: set-based label selectors, a
scheduler that keeps a pod Pending/Unschedulable while it does not fit the node's allocatable and
binds it once capacity returns, a container's env and files from ConfigMaps (`envFrom`,
`configMapKeyRef`, ConfigMap volumes), finalizers and graceful deletion times, `pods/log`'s
container rules."""

from __future__ import annotations

import time

import pytest
from kubernetes import client as k8s

from cluster import Cluster

pytestmark = pytest.mark.e2e


@pytest.fixture
def cluster(tmp_path):
    with Cluster(str(tmp_path / "cluster"), allocatable={"cpu": "2", "memory": "4Gi"}) as c:
        print(f"kubelet runtime: {c.kubelet.mode}")
        yield c


def wait_for(predicate, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} not reached in {timeout}s")


def pod(name, image, command=None, labels=None, requests=None, **spec):
    container = k8s.V1Container(name="main", image=image, command=command,
                                resources=k8s.V1ResourceRequirements(requests=requests) if requests else None)
    return k8s.V1Pod(metadata=k8s.V1ObjectMeta(name=name, labels=labels or {"app": "t"}),
                     spec=k8s.V1PodSpec(restart_policy="Never", automount_service_account_token=False,
                                        containers=[container], **spec))


def finished(api, name, namespace):
    return wait_for(lambda: (p := api.read_namespaced_pod(name, namespace)).status.phase in ("Succeeded", "Failed") and p,
                    30, f"{name} finished")


def test_set_based_label_selectors_select_as_the_api_server_does(cluster):
    api, ns = cluster.core(), cluster.namespace
    labelled = {"a": {"tier": "master", "job": "j1"}, "b": {"tier": "worker", "job": "j1"}, "c": {"tier": "worker"}, "d": {}}
    for name, labels in labelled.items():
        api.create_namespaced_config_map(ns, k8s.V1ConfigMap(metadata=k8s.V1ObjectMeta(name=name, labels=labels)))

    def names(selector):
        return sorted(o.metadata.name for o in api.list_namespaced_config_map(ns, label_selector=selector).items
                      if o.metadata.name in labelled)

    assert names("tier in (master,worker)") == ["a", "b", "c"]
    assert names("tier notin (master)") == ["b", "c", "d"]  # notin matches an object without the key
    assert names("job") == ["a", "b"] and names("!job") == ["c", "d"]
    assert names("tier in (worker),!job") == ["c"]
    assert names("tier!=worker") == ["a", "d"]
    assert names("job=j1,tier notin (worker, master)") == []
    with pytest.raises(k8s.ApiException) as refused:
        api.list_namespaced_config_map(ns, label_selector="tier in (master")
    assert refused.value.status == 400 and "unable to parse requirement" in refused.value.body


def test_a_pod_that_does_not_fit_stays_unschedulable_until_capacity_returns(cluster):
    api, ns = cluster.core(), cluster.namespace
    sleeper = ["python", "-c", "import time; time.sleep(60)"]
    api.create_namespaced_pod(ns, pod("big", cluster.project_image, sleeper, requests={"cpu": "1500m", "memory": "1Gi"}))
    wait_for(lambda: api.read_namespaced_pod("big", ns).status.phase == "Running", 30, "big running")
    api.create_namespaced_pod(ns, pod("late", cluster.project_image, ["python", "-c", "print('ran')"], requests={"cpu": "1"}))
    waiting = wait_for(lambda: [c for c in (api.read_namespaced_pod("late", ns).status.conditions or [])
                                if c.type == "PodScheduled" and c.status == "False"], 10, "late marked unschedulable")
    assert waiting[0].reason == "Unschedulable" and "0/1 nodes are available: 1 Insufficient cpu." in waiting[0].message
    late = api.read_namespaced_pod("late", ns)
    assert late.status.phase == "Pending" and late.spec.node_name is None

    cluster.set_allocatable(cpu="4")  # capacity given back: the pending pod is bound and runs
    assert finished(api, "late", ns).status.phase == "Succeeded"
    assert api.read_namespaced_pod_log("late", ns) == "ran\n"

    cluster.set_allocatable(cpu="2", memory="512Mi")  # taken again: a new pod that asks for memory waits
    api.create_namespaced_pod(ns, pod("hungry", cluster.project_image, sleeper, requests={"memory": "1Gi"}))
    waiting = wait_for(lambda: [c for c in (api.read_namespaced_pod("hungry", ns).status.conditions or [])
                                if c.type == "PodScheduled" and c.status == "False"], 10, "hungry marked unschedulable")
    assert "Insufficient memory" in waiting[0].message
    api.delete_namespaced_pod("big", ns, grace_period_seconds=0)  # a finished or deleted pod frees what it held
    cluster.set_allocatable(memory="2Gi")
    wait_for(lambda: api.read_namespaced_pod("hungry", ns).status.phase == "Running", 30, "hungry running")
    scheduled = [c for c in api.read_namespaced_pod("hungry", ns).status.conditions if c.type == "PodScheduled"]
    assert [(c.status, c.reason) for c in scheduled] == [("True", None)]


def test_env_from_config_maps_and_secrets_config_map_keys_and_volumes(cluster):
    api, ns = cluster.core(), cluster.namespace
    api.create_namespaced_config_map(ns, k8s.V1ConfigMap(metadata=k8s.V1ObjectMeta(name="settings"),
                                                         data={"MODE": "fast", "SHARED": "from-map", "bad key": "skipped",
                                                               "model.py": "def model():\n    return 1\n"},
                                                         binary_data={"blob.bin": "AAEC"}))
    api.create_namespaced_secret(ns, k8s.V1Secret(metadata=k8s.V1ObjectMeta(name="creds"), string_data={"KEY": "s3cret"}))
    script = ("import os; print(sorted((k, v) for k, v in os.environ.items() if k in ('MODE', 'SHARED', 'S_KEY', 'ONE', 'NONE')));"
              "print(sorted(os.listdir('/config/settings')), open('/config/settings/model.py').read().splitlines()[0],"
              " list(open('/config/settings/blob.bin', 'rb').read()), os.listdir('/config/maybe'))")
    body = pod("reader", cluster.project_image, ["python", "-c", script],
               volumes=[k8s.V1Volume(name="settings", config_map=k8s.V1ConfigMapVolumeSource(name="settings")),
                        k8s.V1Volume(name="maybe", config_map=k8s.V1ConfigMapVolumeSource(name="absent", optional=True))])
    main = body.spec.containers[0]
    main.env_from = [k8s.V1EnvFromSource(config_map_ref=k8s.V1ConfigMapEnvSource(name="settings")),
                     k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name="creds"), prefix="S_"),
                     k8s.V1EnvFromSource(config_map_ref=k8s.V1ConfigMapEnvSource(name="absent", optional=True))]
    key_ref = lambda name, key, optional=None: k8s.V1EnvVarSource(  # noqa: E731
        config_map_key_ref=k8s.V1ConfigMapKeySelector(name=name, key=key, optional=optional))
    main.env = [k8s.V1EnvVar(name="SHARED", value="from-env"),  # env wins over envFrom
                k8s.V1EnvVar(name="ONE", value_from=key_ref("settings", "MODE")),
                k8s.V1EnvVar(name="NONE", value_from=key_ref("settings", "absent", optional=True))]
    main.volume_mounts = [k8s.V1VolumeMount(name="settings", mount_path="/config/settings"),
                          k8s.V1VolumeMount(name="maybe", mount_path="/config/maybe")]
    api.create_namespaced_pod(ns, body)
    done = finished(api, "reader", ns)
    out = api.read_namespaced_pod_log("reader", ns)
    assert done.status.phase == "Succeeded", out
    assert "[('MODE', 'fast'), ('ONE', 'fast'), ('SHARED', 'from-env'), ('S_KEY', 's3cret')]" in out
    assert "['MODE', 'SHARED', 'bad key', 'blob.bin', 'model.py'] def model(): [0, 1, 2] []" in out

    missing = pod("missing", cluster.project_image, ["true"])
    missing.spec.containers[0].env = [k8s.V1EnvVar(name="X", value_from=key_ref("settings", "nope"))]
    api.create_namespaced_pod(ns, missing)
    state = wait_for(lambda: (s := api.read_namespaced_pod("missing", ns).status).container_statuses and
                     s.container_statuses[0].state.waiting, 20, "missing key reported")
    assert state.reason == "CreateContainerConfigError" and "couldn't find key nope in ConfigMap" in state.message
