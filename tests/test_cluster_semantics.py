"""The API semantics of the cluster stand-in that the backends, `elastic-step submit` and the
preemption tests rely on, each as the real Kubernetes behaves: set-based label selectors, a
scheduler that keeps a pod Pending/Unschedulable while it does not fit the node's allocatable and
binds it once capacity returns, a container's env and files from ConfigMaps (`envFrom`,
`configMapKeyRef`, ConfigMap volumes), finalizers and graceful deletion times, `pods/log`'s
container rules."""

from __future__ import annotations

import json
import os
import time

import pytest
from kubernetes import client as k8s

from cluster import Cluster
from waiting import wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture
def cluster(tmp_path):
    with Cluster(str(tmp_path / "cluster"), allocatable={"cpu": "2", "memory": "4Gi"}) as c:
        print(f"kubelet runtime: {c.kubelet.mode}")
        yield c


def pod(name, image, command=None, labels=None, requests=None, **spec):
    container = k8s.V1Container(name="main", image=image, command=command,
                                resources=k8s.V1ResourceRequirements(requests=requests) if requests else None)
    return k8s.V1Pod(metadata=k8s.V1ObjectMeta(name=name, labels=labels or {"app": "t"}),
                     spec=k8s.V1PodSpec(restart_policy="Never", automount_service_account_token=False,
                                        containers=[container], **spec))


def message(refused) -> str:
    return json.loads(refused.value.body)["message"]


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
    assert refused.value.status == 400 and "unable to parse requirement" in message(refused)


def test_a_pod_that_does_not_fit_stays_unschedulable_until_capacity_returns(cluster):
    api, ns = cluster.core(), cluster.namespace
    sleeper = ["python", "-c", "import time; time.sleep(60)"]
    api.create_namespaced_pod(ns, pod("big", cluster.project_image, sleeper, requests={"cpu": "1500m", "memory": "1Gi"}))
    wait_for(lambda: api.read_namespaced_pod("big", ns).status.phase == "Running", 30, "big running")
    api.create_namespaced_pod(ns, pod("late", cluster.project_image, ["python", "-c", "print('ran')"], requests={"cpu": "1"}))
    waiting = wait_for(lambda: [c for c in (api.read_namespaced_pod("late", ns).status.conditions or [])
                                if c.type == "PodScheduled" and c.status == "False"], 10, "late marked unschedulable")
    assert waiting[0].reason == "Unschedulable" and "0/1 nodes are available: 1 Insufficient cpu." in waiting[0].message
    assert "No preemption victims found" in waiting[0].message  # it would fit once `big` is gone
    late = api.read_namespaced_pod("late", ns)
    assert late.status.phase == "Pending" and late.spec.node_name is None
    events = api.list_namespaced_event(ns, field_selector=f"involvedObject.name=late,involvedObject.uid={late.metadata.uid}").items
    assert [(e.type, e.reason, e.message) for e in events] == [("Warning", "FailedScheduling", waiting[0].message)]

    cluster.set_allocatable(cpu="4")  # capacity given back: the pending pod is bound and runs
    assert finished(api, "late", ns).status.phase == "Succeeded"
    assert api.read_namespaced_pod_log("late", ns) == "ran\n"

    cluster.set_allocatable(cpu="2", memory="512Mi")  # taken again: a new pod that asks for memory waits
    api.create_namespaced_pod(ns, pod("hungry", cluster.project_image, sleeper, requests={"memory": "1Gi"}))
    waiting = wait_for(lambda: [c for c in (api.read_namespaced_pod("hungry", ns).status.conditions or [])
                                if c.type == "PodScheduled" and c.status == "False"], 10, "hungry marked unschedulable")
    assert "Insufficient memory" in waiting[0].message
    # More than the node's allocatable: nothing freed could help, as kube-scheduler says (a pod the
    # master gives up after --pending-timeout, where one that only waits for capacity waits on).
    assert "Preemption is not helpful for scheduling" in waiting[0].message
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


def test_finalizers_hold_a_deleted_object_and_deletion_timestamp_is_now_plus_grace(cluster):
    api, ns = cluster.core(), cluster.namespace
    held = k8s.V1ConfigMap(metadata=k8s.V1ObjectMeta(name="held", finalizers=["example.com/cleanup"]))
    api.create_namespaced_config_map(ns, held)
    api.delete_namespaced_config_map("held", ns)
    marked = api.read_namespaced_config_map("held", ns)  # still there, marked, until its finalizer goes
    assert marked.metadata.deletion_timestamp is not None and marked.metadata.finalizers == ["example.com/cleanup"]
    api.patch_namespaced_config_map("held", ns, {"metadata": {"finalizers": None}})
    with pytest.raises(k8s.ApiException) as gone:
        api.read_namespaced_config_map("held", ns)
    assert gone.value.status == 404

    sleeper = ["python", "-c", "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
                               "print('up', flush=True)\ntime.sleep(60)"]
    api.create_namespaced_pod(ns, pod("graceful", cluster.project_image, sleeper, termination_grace_period_seconds=20))
    wait_for(lambda: api.read_namespaced_pod("graceful", ns).status.phase == "Running", 30, "graceful running")
    wait_for(lambda: b"up" in api.read_namespaced_pod_log("graceful", ns, _preload_content=False).data, 30, "graceful up")
    asked = time.time()
    deleting = api.delete_namespaced_pod("graceful", ns)
    assert deleting.metadata.deletion_grace_period_seconds == 20
    assert abs(deleting.metadata.deletion_timestamp.timestamp() - (asked + 20)) < 2.5
    wait_for(lambda: cluster.server.get("pods", ns, "graceful") is None, 15, "graceful gone after SIGTERM")


def test_pods_log_of_a_pod_with_several_containers_names_one(cluster):
    api, ns = cluster.core(), cluster.namespace
    body = pod("pair", cluster.project_image, ["python", "-c", "print('first')"])
    body.spec.containers.append(k8s.V1Container(name="second", image=cluster.project_image, command=["python", "-c", "print('second')"]))
    api.create_namespaced_pod(ns, body)
    finished(api, "pair", ns)
    with pytest.raises(k8s.ApiException) as unnamed:
        api.read_namespaced_pod_log("pair", ns)
    assert unnamed.value.status == 400
    assert "a container name must be specified for pod pair, choose one of: [main second]" in message(unnamed)
    assert api.read_namespaced_pod_log("pair", ns, container="second") == "second\n"
    with pytest.raises(k8s.ApiException) as unknown:
        api.read_namespaced_pod_log("pair", ns, container="third")
    assert unknown.value.status == 400 and "container third is not valid for pod pair" in message(unknown)


RESTRICTED = dict(
    security_context=k8s.V1PodSecurityContext(run_as_non_root=True, run_as_user=1000,
                                              seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault")))


def restricted_container(container):
    container.security_context = k8s.V1SecurityContext(allow_privilege_escalation=False,
                                                       capabilities=k8s.V1Capabilities(drop=["ALL"]))
    return container


def test_pod_security_admission_enforces_restricted_on_a_labelled_namespace(cluster):
    api = cluster.core()
    api.patch_namespace("other", {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}})
    with pytest.raises(k8s.ApiException) as refused:
        api.create_namespaced_pod("other", pod("bare", cluster.project_image, ["true"]))
    assert refused.value.status == 403
    assert ('pods "bare" is forbidden: violates PodSecurity "restricted:latest": allowPrivilegeEscalation != false '
            '(container "main" must set securityContext.allowPrivilegeEscalation=false), unrestricted capabilities '
            '(container "main" must set securityContext.capabilities.drop=["ALL"]), runAsNonRoot != true (pod or '
            'container "main" must set securityContext.runAsNonRoot=true), seccompProfile (pod or container "main" '
            'must set securityContext.seccompProfile.type to "RuntimeDefault" or "Localhost")') in message(refused)
    host = pod("host", cluster.project_image, ["true"], volumes=[k8s.V1Volume(name="node", host_path=k8s.V1HostPathVolumeSource(path="/"))],
               host_network=True, **RESTRICTED)
    restricted_container(host.spec.containers[0])
    with pytest.raises(k8s.ApiException) as refused:
        api.create_namespaced_pod("other", host)
    assert 'host namespaces (hostNetwork=true)' in message(refused)
    assert 'restricted volume types (volumes ["node"] have restricted types)' in message(refused)

    good = pod("good", cluster.project_image, ["python", "-c", "import os; print(os.getuid())"], **RESTRICTED)
    restricted_container(good.spec.containers[0])
    api.create_namespaced_pod("other", good)
    done = finished(api, "good", "other")
    assert done.status.phase == "Succeeded" and api.read_namespaced_pod_log("good", "other").strip() in ("1000", str(os.getuid()))
    assert cluster.server.get("pods", cluster.namespace, "good") is None  # and the unlabelled namespace admits anything:
    api.create_namespaced_pod(cluster.namespace, pod("bare", cluster.project_image, ["true"]))


def test_the_masters_worker_pods_pass_restricted_pod_security():
    from cluster.admission import pod_security_failures
    from elastic_step.backends.kubernetes import manifests
    from elastic_step.backends.kubernetes.options import PodSettings

    settings = PodSettings(namespace="ml", image="img", cpu_request="1", memory_request="1Gi", memory_limit="1Gi")
    worker = manifests.worker_pod(settings, manifests.JobNames.for_job("job"), None, "img", "w1.0", 0, "http://10.0.0.1:8080")
    assert pod_security_failures(manifests.to_dict(worker)["spec"], "restricted") == []


def test_resource_quota_refuses_pods_without_requests_and_beyond_the_quota(cluster):
    api, ns = cluster.core(), cluster.namespace
    api.create_namespaced_resource_quota(ns, k8s.V1ResourceQuota(metadata=k8s.V1ObjectMeta(name="compute"),
                                                                 spec=k8s.V1ResourceQuotaSpec(hard={"requests.cpu": "2", "requests.memory": "2Gi"})))
    with pytest.raises(k8s.ApiException) as refused:
        api.create_namespaced_pod(ns, pod("bare", cluster.project_image, ["true"]))
    assert refused.value.status == 403
    assert ('pods "bare" is forbidden: failed quota: compute: must specify requests.cpu for: main; requests.memory for: main'
            in message(refused))
    sleeper = ["python", "-c", "import time; time.sleep(60)"]
    api.create_namespaced_pod(ns, pod("first", cluster.project_image, sleeper, requests={"cpu": "1500m", "memory": "1Gi"}))
    with pytest.raises(k8s.ApiException) as refused:
        api.create_namespaced_pod(ns, pod("second", cluster.project_image, sleeper, requests={"cpu": "1", "memory": "1Gi"}))
    assert ("exceeded quota: compute, requested: requests.cpu=1, used: requests.cpu=1500m, limited: requests.cpu=2"
            in message(refused))
    api.create_namespaced_pod(ns, pod("small", cluster.project_image, sleeper, requests={"cpu": "500m", "memory": "1Gi"}))


def test_a_failed_container_restarts_in_place_with_its_count_and_last_state(cluster):
    api, ns = cluster.core(), cluster.namespace
    script = ("import os, sys\nruns = len(os.listdir('/state'))\nopen(f'/state/run{runs}', 'w').close()\n"
              "print('run', runs, flush=True)\nsys.exit(3 if runs == 0 else 0)")
    body = pod("flaky", cluster.project_image, ["python", "-c", script],
               volumes=[k8s.V1Volume(name="state", empty_dir=k8s.V1EmptyDirVolumeSource())])
    body.spec.restart_policy = "OnFailure"
    body.spec.containers[0].volume_mounts = [k8s.V1VolumeMount(name="state", mount_path="/state")]
    api.create_namespaced_pod(ns, body)
    done = finished(api, "flaky", ns)
    status = done.status.container_statuses[0]
    assert done.status.phase == "Succeeded" and status.restart_count == 1
    assert status.last_state.terminated.exit_code == 3 and status.last_state.terminated.reason == "Error"
    assert status.state.terminated.exit_code == 0
    assert api.read_namespaced_pod_log("flaky", ns) == "run 1\n"
    assert api.read_namespaced_pod_log("flaky", ns, previous=True) == "run 0\n"


def test_a_pod_the_node_evicts_fails_with_reason_evicted(cluster):
    api, ns = cluster.core(), cluster.namespace
    body = pod("evicted", cluster.project_image, ["python", "-c", "import time; time.sleep(60)"])
    body.spec.restart_policy = "Always"  # an evicted pod is never restarted
    api.create_namespaced_pod(ns, body)
    wait_for(lambda: api.read_namespaced_pod("evicted", ns).status.phase == "Running", 30, "evicted running")
    cluster.kubelet.evict(ns, "evicted", "memory")
    done = finished(api, "evicted", ns)
    assert (done.status.phase, done.status.reason) == ("Failed", "Evicted")
    assert done.status.message.startswith("The node was low on resource: memory.")
    assert [c.reason for c in done.status.conditions if c.type == "DisruptionTarget"] == ["TerminationByKubelet"]
    node_side = cluster.kubelet.record(ns, "evicted").containers[0]  # not to be started again, whatever its policy
    assert node_side.exit is not None and node_side.restart_at is None
    kept = api.read_namespaced_pod("evicted", ns)  # the object stays until someone deletes it
    assert kept.status.phase == "Failed" and kept.status.container_statuses[0].restart_count == 0
