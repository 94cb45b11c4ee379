"""The cluster stand-in (tests/cluster) against the real `kubernetes` client: what the master's
backend relies on from an API server — HTTPS with in-cluster config, list + watch with
resourceVersion, 410 Gone, watch timeouts, RBAC from deploy/, garbage collection — and what it
relies on from a kubelet: pods that see only what their spec gives them, real OOM kills,
SIGKILLs and graceful deletion, all reported through the API."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
from kubernetes import client as k8s
from kubernetes import watch

from cluster import Cluster, role_rules
from cluster.runtime import can_isolate
from elastic_step.backends.kubernetes import client as es_client
from waiting import wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture
def cluster(tmp_path):
    with Cluster(str(tmp_path / "cluster")) as c:
        print(f"kubelet runtime: {c.kubelet.mode}")
        yield c


@pytest.fixture
def master_api(cluster, tmp_path, monkeypatch):
    """The CoreV1Api the master builds for itself, from in-cluster config only."""
    folder = cluster.service_account_folder(str(tmp_path / "serviceaccount"))
    for key, value in cluster.in_cluster_env(folder).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    return es_client.load_core_api()


def pod(name, labels=None, image="registry.example/none:1", command=None, owner=None, **spec):
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(name=name, labels=labels or {"app": "t"}, owner_references=owner),
        spec=k8s.V1PodSpec(restart_policy="Never", automount_service_account_token=False, containers=[
            k8s.V1Container(name="main", image=image, command=command)], **spec),
    )


def owner_ref(obj):
    return [k8s.V1OwnerReference(api_version="v1", kind="Pod", name=obj.metadata.name, uid=obj.metadata.uid)]


def test_in_cluster_client_creates_lists_watches_and_deletes_over_https(cluster, master_api):
    assert master_api.api_client.configuration.host.startswith("https://127.0.0.1:")
    listed = master_api.list_namespaced_pod(cluster.namespace, label_selector="app=t")
    assert listed.items == [] and int(listed.metadata.resource_version) > 0
    events, done = [], threading.Event()

    def watcher():
        for event in watch.Watch().stream(master_api.list_namespaced_pod, cluster.namespace, label_selector="app=t",
                                          resource_version=listed.metadata.resource_version, timeout_seconds=10):
            events.append((event["type"], event["object"].metadata.name, event["object"].status.phase if event["object"].status else None))
            if event["type"] == "DELETED":
                break
        done.set()

    thread = threading.Thread(target=watcher, daemon=True)
    thread.start()
    created = master_api.create_namespaced_pod(cluster.namespace, pod("p1"))
    assert created.metadata.uid and created.metadata.creation_timestamp and created.status.phase == "Pending"
    master_api.create_namespaced_pod(cluster.namespace, pod("other", labels={"app": "x"}))
    with pytest.raises(k8s.ApiException) as exists:
        master_api.create_namespaced_pod(cluster.namespace, pod("p1"))
    assert exists.value.status == 409
    # The kubelet binds it; the image is unknown, so it waits in ErrImagePull.
    got = wait_for(lambda: (p := master_api.read_namespaced_pod("p1", cluster.namespace)).status.container_statuses and p)
    assert got.spec.node_name == "node-1" and got.status.container_statuses[0].state.waiting.reason == "ErrImagePull"
    assert [p.metadata.name for p in master_api.list_namespaced_pod(cluster.namespace, label_selector="app=t").items] == ["p1"]
    master_api.delete_namespaced_pod("p1", cluster.namespace, grace_period_seconds=0)
    assert done.wait(10), events
    kinds = [e[0] for e in events if e[1] == "p1"]
    assert kinds[0] == "ADDED" and "MODIFIED" in kinds and kinds[-1] == "DELETED"
    assert all(e[1] == "p1" for e in events)  # the selector filtered the other pod out
    with pytest.raises(k8s.ApiException) as missing:
        master_api.read_namespaced_pod("p1", cluster.namespace)
    assert missing.value.status == 404 and '"NotFound"' in missing.value.body


def test_a_watch_from_a_compacted_version_gets_410_gone_and_a_watch_ends_at_its_timeout(cluster, master_api):
    rv = master_api.list_namespaced_pod(cluster.namespace).metadata.resource_version
    started = time.monotonic()
    assert list(watch.Watch().stream(master_api.list_namespaced_pod, cluster.namespace, resource_version=rv, timeout_seconds=1)) == []
    assert 0.9 < time.monotonic() - started < 5
    master_api.create_namespaced_pod(cluster.namespace, pod("p2"))
    cluster.server.compact()
    with pytest.raises(k8s.ApiException) as gone:
        list(watch.Watch().stream(master_api.list_namespaced_pod, cluster.namespace, resource_version=rv, timeout_seconds=5))
    assert gone.value.status == 410
    # A fresh list gives a version to watch from again.
    fresh = master_api.list_namespaced_pod(cluster.namespace).metadata.resource_version
    after = list(watch.Watch().stream(master_api.list_namespaced_pod, cluster.namespace, resource_version=fresh, timeout_seconds=1))
    assert all(e["object"].metadata.name == "p2" for e in after)  # only what the kubelet did to p2 since


def test_rbac_is_the_role_in_deploy_in_its_own_namespace_only(cluster, master_api):
    granted = role_rules()
    assert ("create", "pods") in granted and ("list", "secrets") not in granted
    ns = cluster.namespace
    secret = k8s.V1Secret(metadata=k8s.V1ObjectMeta(name="s1"), string_data={"k": "v"})
    master_api.create_namespaced_secret(ns, secret)
    with pytest.raises(k8s.ApiException) as denied:
        master_api.list_namespaced_secret(ns)  # a verb the Role does not grant
    assert denied.value.status == 403
    assert '"kind": "Status"' in denied.value.body and '"reason": "Forbidden"' in denied.value.body
    assert f"system:serviceaccount:{ns}:{cluster.service_account}" in denied.value.body
    with pytest.raises(k8s.ApiException) as elsewhere:
        master_api.create_namespaced_pod("other", pod("p3"))  # a namespace it is not bound in
    assert elsewhere.value.status == 403 and 'in the namespace \\"other\\"' in elsewhere.value.body
    with pytest.raises(k8s.ApiException) as cluster_wide:
        master_api.list_pod_for_all_namespaces()
    assert cluster_wide.value.status == 403, cluster_wide.value.body
    # Another service account of the same namespace has no Role at all.
    default_api = cluster.core(cluster.token_for(ns, "default"))
    with pytest.raises(k8s.ApiException) as nobody:
        default_api.list_namespaced_pod(ns)
    assert nobody.value.status == 403
    # No token: 401.
    anonymous = k8s.CoreV1Api(k8s.ApiClient(cluster.configuration("not-a-token")))
    with pytest.raises(k8s.ApiException) as unknown:
        anonymous.list_namespaced_pod(ns)
    assert unknown.value.status == 401
    master_api.delete_namespaced_secret("s1", ns)
    assert cluster.used() == {("create", "secrets", ns), ("delete", "secrets", ns)}
    assert cluster.refused() == {("list", "secrets", ns), ("create", "pods", "other"), ("list", "pods", "")}


def test_a_namespaced_role_may_grant_get_on_its_own_namespace_and_no_other(cluster):
    # As Kubernetes' RequestInfo has it: GET /api/v1/namespaces/NAME is a request in namespace NAME,
    # so the deploy step's Role (deploy/serving) can read its own namespace and no other.
    ns = cluster.namespace
    cluster.apply([
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "elsewhere"}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "reader", "namespace": ns}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "ns-reader", "namespace": ns},
         "rules": [{"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "ns-reader", "namespace": ns},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "ns-reader"},
         "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": ns}]},
    ])
    reader = cluster.core(cluster.token_for(ns, "reader"))
    assert reader.read_namespace(ns).metadata.name == ns
    with pytest.raises(k8s.ApiException) as other:
        reader.read_namespace("elsewhere")
    assert other.value.status == 403
    with pytest.raises(k8s.ApiException) as listed:
        reader.list_namespace()  # cluster-wide: a Role never grants it
    assert listed.value.status == 403


def test_the_garbage_collector_deletes_dependents_in_the_owners_namespace_only(cluster):
    api = cluster.core()
    ns = cluster.namespace
    owner = api.create_namespaced_pod(ns, pod("owner"))
    api.create_namespaced_pod(ns, pod("dependent", owner=owner_ref(owner)))
    api.create_namespaced_secret(ns, k8s.V1Secret(metadata=k8s.V1ObjectMeta(name="dep-secret", owner_references=owner_ref(owner))))
    api.create_namespaced_pod(ns, pod("bystander"))
    # An owner reference to a pod of another namespace is dangling: the collector deletes it.
    api.create_namespaced_secret("other", k8s.V1Secret(metadata=k8s.V1ObjectMeta(name="cross", owner_references=owner_ref(owner))))
    wait_for(lambda: not cluster.objects("secrets", "other"), 5, "the cross-namespace dependent collected")
    assert {p["metadata"]["name"] for p in cluster.pods()} == {"owner", "dependent", "bystander"}
    api.delete_namespaced_pod("owner", ns, grace_period_seconds=0)
    wait_for(lambda: {p["metadata"]["name"] for p in cluster.pods()} == {"bystander"}, 10, "dependents deleted")
    assert [s["metadata"]["name"] for s in cluster.objects("secrets")] == []


def test_every_call_of_the_masters_client_has_a_timeout(monkeypatch, tmp_path):
    """An API server that accepts and never answers ends the call with an error, not a hang."""
    import ssl

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    from cluster import make_certificates

    ca, _, _ = make_certificates(str(tmp_path / "pki"))
    folder = tmp_path / "sa"
    folder.mkdir()
    (folder / "token").write_text("t")
    (folder / "ca.crt").write_text(open(ca).read())
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(silent.getsockname()[1]))
    monkeypatch.setenv("ELASTIC_STEP_SERVICEACCOUNT_DIR", str(folder))
    monkeypatch.setattr(es_client, "REQUEST_TIMEOUT", (0.3, 0.3))  # the server never answers: any timeout ends it
    api = es_client.load_core_api()
    started = time.monotonic()
    with pytest.raises(Exception) as stalled:
        api.list_namespaced_pod("ml")
    assert time.monotonic() - started < 10, "the call waited past its timeout"
    assert not isinstance(stalled.value, ssl.SSLCertVerificationError)
    # The backend's own timeouts are floats (30.0), which the client's REST layer ignores unless
    # they are ints: a watch given one, on a connection that went silent, must end too.
    ended = []

    def watch_with_a_float_timeout():
        try:
            list(watch.Watch().stream(api.list_namespaced_pod, "ml", timeout_seconds=1, _request_timeout=0.5))
        except Exception as exc:
            ended.append(exc)

    started = time.monotonic()
    waiting = threading.Thread(target=watch_with_a_float_timeout, daemon=True)
    waiting.start()
    waiting.join(20)
    assert ended and time.monotonic() - started < 20, "a watch with a float request timeout hung on a silent server"
    silent.close()


# -- the kubelet ----------------------------------------------------------------------------------

def run_pod(cluster, name, script, timeout=30, **spec):
    """A pod of the project's image running `python -c script`; its final V1Pod and log."""
    api = cluster.core()
    body = pod(name, image=cluster.project_image, command=["python", "-c", script], **spec)
    api.create_namespaced_pod(cluster.namespace, body)
    done = wait_for(lambda: (p := api.read_namespaced_pod(name, cluster.namespace)).status.phase in ("Succeeded", "Failed") and p,
                    timeout, f"pod {name} finished")
    return done, api.read_namespaced_pod_log(name, cluster.namespace)


@pytest.mark.parametrize("isolate", [True, False], ids=["namespaces", "folders"])
def test_a_pod_sees_only_its_spec_its_volumes_and_its_own_folders(tmp_path, isolate):
    """Both runtimes: with a mount namespace (what this machine's kind allows: root and unshare)
    and without one (own working folder and HOME, mount paths rewritten)."""
    if isolate and not can_isolate():
        pytest.fail("this node cannot make mount namespaces (needs root and unshare)")
    with Cluster(str(tmp_path / "cluster"), isolate=isolate) as cluster:
        print(f"kubelet runtime: {cluster.kubelet.mode}")
        check_pod_view(cluster, tmp_path)


def check_pod_view(cluster, tmp_path):
    secret_file = tmp_path / "master-job" / "token"
    secret_file.parent.mkdir()
    secret_file.write_text("the master's own file")
    api = cluster.core()
    api.create_namespaced_secret(cluster.namespace, k8s.V1Secret(metadata=k8s.V1ObjectMeta(name="tok"), string_data={"token": "s3cret"}))
    script = f"""
import os, stat
print("env", os.environ.get("ME"), os.environ.get("MY_UID") != "", os.environ.get("IP"), os.environ.get("HOST_MARK"))
st = os.stat(os.environ["TOK"])  # a mount path, given in env as the backend gives its token file
print("secret", open(os.environ["TOK"]).read(), oct(stat.S_IMODE(st.st_mode)))
print("uid", os.getuid(), os.getgid(), sorted(os.getgroups()))
print("master file visible", os.path.exists({str(secret_file)!r}), {cluster.root!r} and os.path.exists({cluster.root!r}))
print("tmp", os.listdir("/tmp"), "cwd", os.getcwd(), "home", os.environ["HOME"] == os.getcwd())
try:
    open("/etc/pod-was-here", "w")
    print("root writable")
except OSError:
    print("root read-only")
"""
    downward = lambda path: k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(field_path=path))  # noqa: E731
    body_spec = dict(
        volumes=[k8s.V1Volume(name="tok", secret=k8s.V1SecretVolumeSource(secret_name="tok", default_mode=0o440))],
        security_context=k8s.V1PodSecurityContext(run_as_user=1000, run_as_group=1000, fs_group=1000),
    )
    os.environ["HOST_MARK"] = "leaked"
    try:
        api_pod = pod("seer", image=cluster.project_image, command=["python", "-c", script], **body_spec)
        api_pod.spec.containers[0].env = [k8s.V1EnvVar(name="ME", value_from=downward("metadata.name")),
                                          k8s.V1EnvVar(name="MY_UID", value_from=downward("metadata.uid")),
                                          k8s.V1EnvVar(name="IP", value_from=downward("status.podIP")),
                                          k8s.V1EnvVar(name="TOK", value="/var/run/tok/token")]
        api_pod.spec.containers[0].volume_mounts = [k8s.V1VolumeMount(name="tok", mount_path="/var/run/tok", read_only=True)]
        api.create_namespaced_pod(cluster.namespace, api_pod)
        done = wait_for(lambda: (p := api.read_namespaced_pod("seer", cluster.namespace)).status.phase in ("Succeeded", "Failed") and p,
                        30, "pod finished")
    finally:
        del os.environ["HOST_MARK"]
    out = api.read_namespaced_pod_log("seer", cluster.namespace)
    print(out)
    assert done.status.phase == "Succeeded", out
    assert "env seer True 127.0.0.1 None" in out
    assert "secret s3cret 0o440" in out
    if cluster.kubelet.isolation == "namespaces":
        assert "uid 1000 1000 [1000]" in out
        assert "master file visible False False" in out
        # its /tmp is its own: empty, but for the image's files where this machine keeps them under /tmp
        image_in_tmp = sorted({path.split("/")[2] for path in cluster.images[cluster.project_image].paths if path.startswith("/tmp/")})
        assert f"tmp {image_in_tmp} cwd /home/elastic home True" in out and "root read-only" in out
    else:  # an own empty working folder as HOME; the rest of the machine is not hidden, the user is the node's
        assert "home True" in out
    status = done.status.container_statuses[0]
    assert status.state.terminated.exit_code == 0 and status.state.terminated.reason == "Completed"
    assert done.status.pod_ip == "127.0.0.1" and done.spec.node_name == "node-1"


def test_a_memory_limit_is_a_real_oom_kill_reported_as_oomkilled(cluster):
    if cluster.kubelet.cgroup_parent is None:
        pytest.fail("no memory cgroup can be made on this node: memory limits cannot be enforced")
    limits = k8s.V1ResourceRequirements(limits={"memory": "64Mi"}, requests={"memory": "64Mi"})
    api = cluster.core()
    body = pod("hog", image=cluster.project_image, command=["python", "-c", "x = bytearray(256 * 2**20); print(len(x))"])
    body.spec.containers[0].resources = limits
    api.create_namespaced_pod(cluster.namespace, body)
    done = wait_for(lambda: (p := api.read_namespaced_pod("hog", cluster.namespace)).status.phase in ("Succeeded", "Failed") and p,
                    30, "pod finished")
    terminated = done.status.container_statuses[0].state.terminated
    assert done.status.phase == "Failed" and terminated.reason == "OOMKilled" and terminated.exit_code == 137


def test_a_killed_container_fails_its_pod_and_an_evicted_pod_is_terminated_then_removed(cluster):
    api = cluster.core()
    ns = cluster.namespace
    sleeper = "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(143))\nprint('up', flush=True)\ntime.sleep(60)"
    for name in ("victim", "evictee"):
        api.create_namespaced_pod(ns, pod(name, image=cluster.project_image, command=["python", "-c", sleeper],
                                          termination_grace_period_seconds=5))
    for name in ("victim", "evictee"):
        wait_for(lambda: api.read_namespaced_pod(name, ns).status.phase == "Running", 30, f"{name} running")
    cluster.kubelet.kill(ns, "victim")  # docker kill
    done = wait_for(lambda: (p := api.read_namespaced_pod("victim", ns)).status.phase == "Failed" and p, 10, "victim failed")
    assert done.status.container_statuses[0].state.terminated.exit_code == 137
    wait_for(lambda: b"up" in api.read_namespaced_pod_log("evictee", ns, _preload_content=False).data, 30, "evictee up")
    eviction = k8s.V1Eviction(metadata=k8s.V1ObjectMeta(name="evictee", namespace=ns))
    api.create_namespaced_pod_eviction("evictee", ns, eviction)  # kubectl drain: marked, then deleted gracefully
    marked = api.read_namespaced_pod("evictee", ns)
    assert marked.metadata.deletion_timestamp is not None
    assert [(c.type, c.reason) for c in marked.status.conditions if c.type == "DisruptionTarget"] == [
        ("DisruptionTarget", "EvictionByEvictionAPI")]
    wait_for(lambda: not [p for p in cluster.pods() if p["metadata"]["name"] == "evictee"], 10, "evictee removed")
    last = [e[4] for e in cluster.server.store.history if e[1] == "pods" and e[4]["metadata"]["name"] == "evictee"][-1]
    assert last["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 143
