"""kubectl (the Debian package's, v1.32) as a real client of the cluster stand-in, beside the Python
one: discovery and OpenAPI (what its RESTMapper, `explain` and `apply` read), `get -o wide|yaml`,
`describe`, `delete`, `get --watch`, `logs` with `-c`, `--tail`, `-f` and `--previous`, `apply -f`
and `apply -k deploy/` (client-side apply: a GET, then a create, or a strategic merge PATCH
carrying the last-applied annotation; RBAC objects made this way grant at once; and server-side
apply, `--server-side`), `--dry-run=server` (`?dryRun=All`: judged, answered, nothing stored), and `auth can-i`
with and without `--list`, with the kubeconfig a user has (`Cluster.kubeconfig`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
import time

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from cluster import Cluster, REPO
from waiting import wait_for

pytestmark = pytest.mark.e2e

KUBECTL = shutil.which("kubectl")


@pytest.fixture
def cluster(tmp_path):
    if KUBECTL is None:
        pytest.fail("kubectl is not installed (.ci/run installs Debian's kubectl)")
    with Cluster(str(tmp_path / "cluster")) as c:
        print(f"kubelet runtime: {c.kubelet.mode}")
        yield c


@pytest.fixture
def kubectl(cluster, tmp_path):
    """kubectl with the admin's kubeconfig; `config=` another user's."""
    admin = cluster.kubeconfig(tmp_path, "admin", cluster.admin_token)

    def run(*args, config=None, check=True, timeout=60, stdin=None):
        env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "KUBECONFIG": config or admin}
        done = subprocess.run([KUBECTL, *args], env=env, capture_output=True, text=True, timeout=timeout, input=stdin)
        if check:
            assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
        return done

    return run


def test_discovery_and_openapi_from_kubernetes_own_schema(kubectl):
    server = json.loads(kubectl("version", "-o", "json").stdout)["serverVersion"]
    assert [line.split()[:2] for line in kubectl("get", "namespaces").stdout.splitlines()][:2] == [["NAME", "STATUS"], ["default", "Active"]]
    assert server["gitVersion"] == "v1.32.0"
    names = kubectl("api-resources", "-o", "name").stdout.split()
    assert {"pods", "configmaps", "nodes", "roles.rbac.authorization.k8s.io", "networkpolicies.networking.k8s.io",
            "selfsubjectrulesreviews.authorization.k8s.io"} <= set(names)
    assert "po" in kubectl("api-resources", "--api-group=").stdout  # short names from discovery
    v2 = json.loads(kubectl("get", "--raw", "/openapi/v2").stdout)
    assert v2["swagger"] == "2.0" and "io.k8s.api.core.v1.PodSpec" in v2["definitions"]
    index = json.loads(kubectl("get", "--raw", "/openapi/v3").stdout)["paths"]
    v3 = json.loads(kubectl("get", "--raw", index["apis/rbac.authorization.k8s.io/v1"]["serverRelativeURL"]).stdout)
    assert v3["openapi"].startswith("3.") and "io.k8s.api.rbac.v1.Role" in v3["components"]["schemas"]
    explained = kubectl("explain", "pod.spec.restartPolicy").stdout  # kubectl reads the v3 document itself
    assert "FIELD: restartPolicy <string>" in explained and "OnFailure" in explained


def test_get_describe_logs_watch_and_delete_a_pod(cluster, kubectl, tmp_path):
    manifest = tmp_path / "two.yaml"
    manifest.write_text(textwrap.dedent(f"""\
        apiVersion: v1
        kind: Pod
        metadata: {{name: two, labels: {{app: two}}}}
        spec:
          restartPolicy: Never
          terminationGracePeriodSeconds: 5
          containers:
          - name: counter
            image: {cluster.project_image}
            command: [python, -c, "import time\\nfor i in range(4):\\n print('line', i, flush=True); time.sleep(0.3)"]
          - name: sleeper
            image: {cluster.project_image}
            command: [python, -c, "import signal, sys, time\\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\\nprint('up', flush=True)\\ntime.sleep(60)"]
        """))
    # A server dry run: the pod as admission makes it (its service account, the token volume), not stored.
    version = cluster.server.store.rv
    answered = yaml.safe_load(kubectl("create", "--dry-run=server", "-f", str(manifest), "-o", "yaml").stdout)
    assert answered["spec"]["serviceAccountName"] == "default" and "resourceVersion" not in answered["metadata"]
    assert any(v["name"].startswith("kube-api-access-") for v in answered["spec"]["volumes"])
    assert cluster.server.get("pods", cluster.namespace, "two") is None and cluster.server.store.rv == version
    with pytest.raises(ApiException) as invalid:  # All is the only dry run there is
        cluster.core().create_namespaced_config_map(cluster.namespace, {"metadata": {"name": "c"}}, dry_run="Some")
    assert invalid.value.status == 422 and json.loads(invalid.value.body)["message"].startswith('dryRun: Unsupported value: "Some"')
    assert "pod/two created" in kubectl("apply", "-f", str(manifest)).stdout
    watcher = subprocess.Popen([KUBECTL, "get", "pods", "--watch", "-o", "wide"], stdout=subprocess.PIPE, text=True,
                               env={"PATH": os.environ["PATH"], "HOME": str(tmp_path),
                                    "KUBECONFIG": str(tmp_path / "admin.kubeconfig")})
    try:
        # As with a real API server, a container still being created has no log to follow yet.
        wait_for(lambda: any(c["name"] == "counter" and ("running" in c["state"] or "terminated" in c["state"])
                             for c in (cluster.server.get("pods", cluster.namespace, "two").get("status") or {})
                             .get("containerStatuses") or []), 120, "the counter container started")
        followed = kubectl("logs", "two", "-c", "counter", "-f").stdout  # streams until the container ends
        assert followed == "line 0\nline 1\nline 2\nline 3\n"
        assert kubectl("logs", "two", "-c", "counter", "--tail", "1").stdout == "line 3\n"
        unnamed = kubectl("logs", "two", check=False)  # kubectl names the first container and says so
        assert unnamed.stdout.startswith("line 0") and 'Defaulted container "counter" out of: counter, sleeper' in unnamed.stderr
        previous = kubectl("logs", "two", "-c", "counter", "--previous", check=False)
        assert previous.returncode != 0 and 'previous terminated container "counter" in pod "two" not found' in previous.stderr

        wide = kubectl("get", "pod", "two", "-o", "wide").stdout.splitlines()
        assert wide[0].split() == ["NAME", "READY", "STATUS", "RESTARTS", "AGE", "IP", "NODE", "NOMINATED", "NODE",
                                   "READINESS", "GATES"]
        assert wide[1].split()[:3] == ["two", "1/2", "Running"] and wide[1].split()[5:7] == ["127.0.0.1", "node-1"]
        as_yaml = yaml.safe_load(kubectl("get", "pod", "two", "-o", "yaml").stdout)
        assert as_yaml["spec"]["nodeName"] == "node-1" and as_yaml["metadata"]["uid"] == cluster.server.get("pods", cluster.namespace, "two")["metadata"]["uid"]
        described = kubectl("describe", "pod", "two").stdout
        assert "Node:             node-1/127.0.0.1" in described and "Reason:       Completed" in described

        assert 'pod "two" deleted' in kubectl("delete", "pod", "two").stdout  # waits until it is gone
        assert cluster.server.get("pods", cluster.namespace, "two") is None
        assert kubectl("get", "pod", "two", check=False).returncode != 0
    finally:
        time.sleep(0.5)
        watcher.terminate()
    seen = [line.split() for line in watcher.communicate(timeout=10)[0].splitlines()]
    statuses = [row[2] for row in seen[1:]]
    assert seen[0][:3] == ["NAME", "READY", "STATUS"] and "Running" in statuses and "Terminating" in statuses


def test_apply_k_deploy_and_rbac_made_through_the_api_grants_at_once_and_a_server_dry_run_changes_nothing(cluster, kubectl, tmp_path):
    first = kubectl("apply", "-k", os.path.join(REPO, "deploy")).stdout
    assert "role.rbac.authorization.k8s.io/elastic-step-master created" in first
    again = kubectl("apply", "-k", os.path.join(REPO, "deploy")).stdout
    assert all(line.endswith("unchanged") for line in again.splitlines()), again
    role = cluster.server.get("roles", cluster.namespace, "elastic-step-master")
    assert "kubectl.kubernetes.io/last-applied-configuration" in role["metadata"]["annotations"]

    # A Role and RoleBinding applied for a service account of `other`: granted as soon as made, gone when deleted.
    token = cluster.token_for("other", "default")
    user = cluster.kubeconfig(tmp_path, "other-default", token)
    grant = tmp_path / "grant.yaml"
    grant.write_text(textwrap.dedent("""\
        apiVersion: rbac.authorization.k8s.io/v1
        kind: Role
        metadata: {name: reader, namespace: other}
        rules: [{apiGroups: [""], resources: [configmaps], verbs: [get, list]}]
        ---
        apiVersion: rbac.authorization.k8s.io/v1
        kind: RoleBinding
        metadata: {name: reader, namespace: other}
        roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: reader}
        subjects: [{kind: ServiceAccount, name: default, namespace: other}]
        """))
    version = cluster.server.store.rv  # a server dry run: answered as the write would be, nothing stored, no watch event
    assert "rolebinding.rbac.authorization.k8s.io/reader created (server dry run)" in kubectl(
        "create", "--dry-run=server", "-f", str(grant)).stdout
    assert cluster.server.get("roles", "other", "reader") is None and cluster.server.store.rv == version
    assert kubectl("auth", "can-i", "list", "configmaps", "-n", "other", config=user, check=False).stdout.strip() == "no"  # no grant yet
    kubectl("apply", "-f", str(grant))
    assert kubectl("auth", "can-i", "list", "configmaps", "-n", "other", config=user).stdout.strip() == "yes"
    assert kubectl("get", "configmaps", "-n", "other", config=user).returncode == 0
    # a strategic merge patch of the applied Role: the rule list is replaced, the annotation follows
    grant.write_text(grant.read_text().replace("verbs: [get, list]", "verbs: [get]"))
    version = cluster.server.store.rv
    assert "role.rbac.authorization.k8s.io/reader configured (server dry run)" in kubectl(
        "apply", "--dry-run=server", "-f", str(grant)).stdout
    assert "role.rbac.authorization.k8s.io/reader patched" in kubectl(  # kubectl patch prints no dry-run suffix
        "patch", "role", "reader", "-n", "other", "--dry-run=server", "--type=merge", "-p", '{"rules": []}').stdout
    assert 'role.rbac.authorization.k8s.io "reader" deleted (server dry run)' in kubectl(
        "delete", "role", "reader", "-n", "other", "--dry-run=server").stdout
    assert cluster.server.get("roles", "other", "reader")["rules"][0]["verbs"] == ["get", "list"]
    assert cluster.server.store.rv == version
    assert "role.rbac.authorization.k8s.io/reader configured" in kubectl("apply", "-f", str(grant)).stdout
    assert kubectl("auth", "can-i", "list", "configmaps", "-n", "other", config=user, check=False).stdout.strip() == "no"
    kubectl("delete", "-f", str(grant))
    assert kubectl("auth", "can-i", "get", "configmaps", "-n", "other", config=user, check=False).stdout.strip() == "no"


def test_server_side_apply_k_deploy_and_field_managers(cluster, kubectl, tmp_path):
    """`kubectl apply --server-side`: PATCH application/apply-patch+yaml with its field manager,
    creating what does not exist; again, nothing changes. A field another manager set differently
    is a conflict until forced; a field the manager stops applying is removed."""
    deploy = os.path.join(REPO, "deploy")
    first = kubectl("apply", "--server-side", "-k", deploy).stdout
    assert "role.rbac.authorization.k8s.io/elastic-step-master serverside-applied" in first, first
    role = cluster.server.get("roles", cluster.namespace, "elastic-step-master")
    [entry] = role["metadata"]["managedFields"]
    assert entry["manager"] == "kubectl" and entry["operation"] == "Apply" and "f:rules" in entry["fieldsV1"], entry
    assert "kubectl.kubernetes.io/last-applied-configuration" not in (role["metadata"].get("annotations") or {})
    version = role["metadata"]["resourceVersion"]
    kubectl("apply", "--server-side", "-k", deploy)
    assert cluster.server.get("roles", cluster.namespace, "elastic-step-master")["metadata"]["resourceVersion"] == version

    config = tmp_path / "settings.yaml"
    config.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: settings, namespace: other}\ndata: {a: '1', b: '2'}\n")
    kubectl("apply", "--server-side", "--field-manager", "team-a", "-f", str(config))
    config.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: settings, namespace: other}\ndata: {a: '9'}\n")
    clash = kubectl("apply", "--server-side", "--field-manager", "team-b", "-f", str(config), check=False)
    assert clash.returncode != 0 and "conflict" in clash.stderr.lower() and "team-a" in clash.stderr, clash.stderr
    kubectl("apply", "--server-side", "--field-manager", "team-b", "--force-conflicts", "-f", str(config))
    assert cluster.server.get("configmaps", "other", "settings")["data"] == {"a": "9", "b": "2"}
    config.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: settings, namespace: other}\ndata: {}\n")
    kubectl("apply", "--server-side", "--field-manager", "team-a", "-f", str(config))  # team-a stops applying b
    assert cluster.server.get("configmaps", "other", "settings")["data"] == {"a": "9"}


def test_auth_can_i_with_and_without_list_for_the_masters_service_account(cluster, kubectl, tmp_path):
    master = cluster.kubeconfig(tmp_path, "master", cluster.token_for(cluster.namespace, cluster.service_account))
    assert kubectl("auth", "can-i", "create", "pods", config=master).stdout.strip() == "yes"
    assert kubectl("auth", "can-i", "create", "pods", "-n", "other", config=master, check=False).stdout.strip() == "no"
    assert kubectl("auth", "can-i", "delete", "nodes", config=master, check=False).stdout.strip() == "no"
    listed = kubectl("auth", "can-i", "--list", config=master).stdout.splitlines()
    assert listed[0].split()[:3] == ["Resources", "Non-Resource", "URLs"]
    pods = [line for line in listed if line.split()[0] == "pods"]
    assert pods and "create" in pods[0] and "delete" in pods[0]
    assert not [line for line in listed if line.split()[0] in ("nodes", "*.*")]


def test_make_cluster_comes_up_for_kubectl_and_stops_cleanly(tmp_path):
    """`make cluster` (cluster/local.py): up, usable with the kubeconfig it writes, and gone,
    every server with it, on SIGTERM (`make cluster-stop`)."""
    if KUBECTL is None:
        pytest.fail("kubectl is not installed (.ci/run installs Debian's kubectl)")
    import signal
    import sys

    root = tmp_path / "local"
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "tests")}
    proc = subprocess.Popen([sys.executable, "-m", "cluster.local", "--root", str(root)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Stop it:"):
                break
        output = "".join(lines)
        assert "Local cluster stand-in up" in output, output
        kubeconfig = str(root / "admin.kubeconfig")
        assert f"export KUBECONFIG={kubeconfig}" in output
        assert oct(os.stat(kubeconfig).st_mode & 0o777) == "0o600" and oct(os.stat(root / "env").st_mode & 0o777) == "0o600"
        settings = dict(line.split("=", 1) for line in (root / "env").read_text().splitlines())
        assert settings["MLFLOW_TRACKING_USERNAME"] == "elastic-step" and settings["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")
        assert settings["MLFLOW_TRACKING_PASSWORD"] not in output  # the secrets are in the private file only
        run_env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "KUBECONFIG": kubeconfig}
        nodes = subprocess.run([KUBECTL, "get", "nodes"], env=run_env, capture_output=True, text=True, timeout=60)
        assert nodes.returncode == 0 and "node-1   Ready" in nodes.stdout, nodes.stderr
        secrets = subprocess.run([KUBECTL, "get", "secrets", "-o", "name"], env=run_env, capture_output=True, text=True, timeout=60)
        assert {"secret/elastic-step-data-reader", "secret/mlflow-credentials"} <= set(secrets.stdout.split())
        pid = int((root / "cluster.pid").read_text())
        assert pid == proc.pid
        os.kill(pid, signal.SIGTERM)  # what `make cluster-stop` sends
        assert proc.wait(60) == 0
        assert not (root / "cluster.pid").exists()
        import httpx

        for url in (settings["MLFLOW_TRACKING_URI"] + "/health", settings["AWS_ENDPOINT_URL"]):
            with pytest.raises(httpx.HTTPError):
                httpx.get(url, timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cordon_drain_and_uncordon_the_node(cluster, kubectl):
    """`kubectl cordon` keeps new pods Pending/Unschedulable, `drain` evicts the running ones
    through the Eviction API (DisruptionTarget first), `uncordon` lets the pending ones run."""
    sleeper = ["--restart=Never", f"--image={cluster.project_image}", "--command", "--", "python", "-c", "import time; time.sleep(60)"]
    kubectl("run", "running", *sleeper)
    wait_for(lambda: (cluster.server.get("pods", cluster.namespace, "running") or {}).get("status", {}).get("phase") == "Running",
             timeout=30, what="running pod running")
    kubectl("cordon", "node-1")
    assert "Ready,SchedulingDisabled" in kubectl("get", "node", "node-1").stdout
    kubectl("run", "waiting", "--restart=Never", f"--image={cluster.project_image}", "--command", "--", "python", "-c", "print('ran')")
    waiting = wait_for(lambda: [c for c in (cluster.server.get("pods", cluster.namespace, "waiting").get("status") or {}).get("conditions", [])
                                if c["type"] == "PodScheduled" and c["status"] == "False"], timeout=30, what="waiting pod unschedulable")
    assert "1 node(s) were unschedulable" in waiting[0]["message"]
    described = kubectl("describe", "pod", "waiting").stdout
    assert "Warning  FailedScheduling" in described and "default-scheduler" in described, described
    drained = kubectl("drain", "node-1", "--force", "--pod-selector", "run=running", "--grace-period=1", "--timeout=60s")
    assert "pod/running evicted" in drained.stdout and "node/node-1 drained" in drained.stdout
    evicted = [e[4] for e in cluster.server.store.history if e[1] == "pods" and e[4]["metadata"]["name"] == "running"]
    assert any(c["type"] == "DisruptionTarget" and c["reason"] == "EvictionByEvictionAPI"
               for e in evicted for c in e.get("status", {}).get("conditions", []))
    kubectl("uncordon", "node-1")
    wait_for(lambda: (cluster.server.get("pods", cluster.namespace, "waiting") or {}).get("status", {}).get("phase") == "Succeeded",
             timeout=30, what="waiting pod ran after uncordon")


def test_logs_previous_and_restarts_after_a_restart_in_place(cluster, kubectl, tmp_path):
    manifest = tmp_path / "flaky.yaml"
    manifest.write_text(textwrap.dedent(f"""\
        apiVersion: v1
        kind: Pod
        metadata: {{name: flaky}}
        spec:
          restartPolicy: OnFailure
          volumes: [{{name: state, emptyDir: {{}}}}]
          containers:
          - name: main
            image: {cluster.project_image}
            volumeMounts: [{{name: state, mountPath: /state}}]
            command: [python, -c, "import os, sys\\nruns = len(os.listdir('/state'))\\nopen(f'/state/{{runs}}', 'w').close()\\nprint('run', runs)\\nsys.exit(3 if runs == 0 else 0)"]
        """))
    kubectl("apply", "-f", str(manifest))
    wait_for(lambda: (cluster.server.get("pods", cluster.namespace, "flaky") or {}).get("status", {}).get("phase") == "Succeeded",
             timeout=30, what="flaky succeeded")
    row = kubectl("get", "pod", "flaky").stdout.splitlines()[1].split()
    assert row[:4] == ["flaky", "0/1", "Completed", "1"] and row[4].startswith("(")  # RESTARTS: 1 (Ns ago)
    assert kubectl("logs", "flaky").stdout == "run 1\n"
    assert kubectl("logs", "flaky", "--previous").stdout == "run 0\n"
