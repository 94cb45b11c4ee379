"""Pods on networks of their own (tests/cluster/network.py): each pod its own network namespace
and address on a bridge inside a namespace the cluster makes for itself, 127.0.0.1 its own, the
node's servers reached only through the gateway; and NetworkPolicy enforced there with nftables
(tests/cluster/netpolicy.py) for the policies the master makes and deploy/ ships: a pod of
another job, or one without the job's labels, cannot open the master's port, its rendezvous
store or a worker's collective port, while the job trains with its policies on."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import time

import pytest
import yaml
from kubernetes import client as k8s

from cluster import Cluster, venv_image
from cluster.network import available
from cluster.rbac import REPO, kustomize_namespace
from conftest import SLOW_MODEL
from elastic_step.audit import audit_report
from stores import S3Server, upload
from test_cluster_e2e import JOB_DIR, TEST_IMAGE, MasterOnNode, master_pod, store_secret

pytestmark = pytest.mark.e2e

# A pod's own view, printed as JSON: its PID, hostname and what that name resolves to, and
# whether it can open each "host:port" of argv[1:] ("open", "refused", "timeout", "unreachable").
PROBE = r'''
import errno, json, os, socket, sys, threading
result = {"pid": os.getpid(), "hostname": socket.gethostname(), "resolves": socket.getaddrinfo(socket.gethostname(), None)[0][4][0]}
def probe(target):
    host, _, port = target.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
        result[target] = "open"
    except socket.timeout:
        result[target] = "timeout"
    except OSError as exc:
        result[target] = {errno.ECONNREFUSED: "refused", errno.ENETUNREACH: "unreachable", errno.EHOSTUNREACH: "unreachable"}.get(exc.errno, str(exc))
threads = [threading.Thread(target=probe, args=(t,)) for t in sys.argv[1:]]
[t.start() for t in threads]
[t.join() for t in threads]
print(json.dumps(result))
'''

# Listens on 127.0.0.1:7000 and on the pod's own address at every port of argv[1:], answering
# each connection with the pod's name; runs until deleted.
SERVER = r'''
import os, socket, sys, threading, time
def serve(host, port):
    listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    while True:
        conn, _ = listener.accept()
        conn.sendall(os.environ["NAME"].encode()); conn.close()
for host, port in [("127.0.0.1", 7000)] + [(os.environ["POD_IP"], int(p)) for p in sys.argv[1:]]:
    threading.Thread(target=serve, args=(host, port), daemon=True).start()
print("serving", flush=True)
time.sleep(3600)
'''


def downward(name: str, path: str) -> k8s.V1EnvVar:
    return k8s.V1EnvVar(name=name, value_from=k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(field_path=path)))


def python_pod(cluster, name: str, script: str, args: list[str], labels: dict | None = None) -> k8s.V1Pod:
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(name=name, labels=labels or {}),
        spec=k8s.V1PodSpec(restart_policy="Never", automount_service_account_token=False, termination_grace_period_seconds=1,
                           containers=[k8s.V1Container(name="main", image=cluster.project_image, command=["python", "-c", script, *args],
                                                       env=[downward("POD_IP", "status.podIP"), downward("NAME", "metadata.name")])]))


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} not reached in {timeout}s")


def serve(cluster, name: str, ports: list[int], namespace: str | None = None, labels: dict | None = None) -> str:
    """A server pod, running and listening; its pod IP."""
    api, namespace = cluster.core(), namespace or cluster.namespace
    api.create_namespaced_pod(namespace, python_pod(cluster, name, SERVER, [str(p) for p in ports], labels))
    wait_for(lambda: "serving" in log_of(cluster, name, namespace), 30, f"{name} serving")
    return api.read_namespaced_pod(name, namespace).status.pod_ip


def log_of(cluster, name: str, namespace: str) -> str:
    try:
        return cluster.core().read_namespaced_pod_log(name, namespace, _preload_content=False).data.decode()
    except k8s.ApiException:
        return ""


def probe(cluster, name: str, targets: list[str], namespace: str | None = None, labels: dict | None = None) -> dict:
    """What a pod of `labels` in `namespace` can open, as PROBE reports it."""
    start_probe(cluster, name, targets, namespace, labels)
    return probe_result(cluster, name, namespace)


def start_probe(cluster, name: str, targets: list[str], namespace: str | None = None, labels: dict | None = None) -> None:
    cluster.core().create_namespaced_pod(namespace or cluster.namespace, python_pod(cluster, name, PROBE, targets, labels))


def probe_result(cluster, name: str, namespace: str | None = None) -> dict:
    api, namespace = cluster.core(), namespace or cluster.namespace
    pod = wait_for(lambda: (p := api.read_namespaced_pod(name, namespace)).status.phase in ("Succeeded", "Failed") and p, 60, f"{name} done")
    out = log_of(cluster, name, namespace)
    assert pod.status.phase == "Succeeded", out
    return {**json.loads(out.strip().splitlines()[-1]), "podIP": pod.status.pod_ip}


def pod_network_cluster(tmp_path, **options) -> Cluster:
    if not available():
        pytest.fail("this node cannot make network namespaces (needs root, iproute2 and unshare --net)")
    return Cluster(str(tmp_path / "cluster"), pod_network=True, **options)


def test_each_pod_has_its_own_address_and_loopback_and_reaches_the_node_only_through_the_gateway(tmp_path):
    with pod_network_cluster(tmp_path) as cluster:
        sandbox = cluster.network.sandbox
        api_port = cluster.server.port
        a = serve(cluster, "server-a", [8080])
        b = serve(cluster, "server-b", [8080])  # the same ports: each pod's loopback and address are its own
        seen = probe(cluster, "client", [f"{a}:8080", f"{b}:8080", "127.0.0.1:7000", f"127.0.0.1:{api_port}",
                                         f"{cluster.network.gateway}:{api_port}", "192.0.2.1:80"])
        addresses = {a, b, seen["podIP"]}
        assert len(addresses) == 3 and all(ipaddress.ip_address(ip) in ipaddress.ip_network("10.244.0.0/16") for ip in addresses)
        assert seen[f"{a}:8080"] == seen[f"{b}:8080"] == "open"
        assert seen["127.0.0.1:7000"] == "refused"  # server-a's and server-b's loopback listeners are theirs alone
        assert seen[f"127.0.0.1:{api_port}"] == "refused"  # the node's loopback is not the pod's
        assert seen[f"{cluster.network.gateway}:{api_port}"] == "open"  # the API server, as KUBERNETES_SERVICE_HOST says
        assert seen["192.0.2.1:80"] in ("unreachable", "timeout")  # nothing routes out of the sandbox
        assert seen["hostname"] == "client" and seen["resolves"] == seen["podIP"]  # /etc/hosts as the kubelet writes it
        # A name longer than a hostname may be (63): cut there, as the kubelet does, a trailing '-' dropped.
        long_name = "client-" + "a" * 55 + "-" + "b" * 10
        long_seen = probe(cluster, long_name, [])
        assert long_seen["hostname"] == long_name[:62] and long_seen["resolves"] == long_seen["podIP"]
        status = json.loads(cluster.core().read_namespaced_pod("server-a", cluster.namespace, _preload_content=False).data)["status"]
        assert status["podIPs"] == [{"ip": a}] and status["podIP"] == a and status["hostIP"] == "127.0.0.1"
        # The API reached from a pod over HTTPS at the gateway, the certificate valid for it.
        check = probe_api(cluster)
        assert check == "403", check
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert sandbox not in listed, listed  # the sandbox and every pod's namespace removed on stop


def probe_api(cluster) -> str:
    """The status a pod without rights gets from the API server through its service address."""
    script = ("import os, ssl, urllib.request, urllib.error\n"
              "ctx = ssl.create_default_context(cafile='/var/run/secrets/kubernetes.io/serviceaccount/ca.crt')\n"
              "token = open('/var/run/secrets/kubernetes.io/serviceaccount/token').read()\n"
              "url = f\"https://{os.environ['KUBERNETES_SERVICE_HOST']}:{os.environ['KUBERNETES_SERVICE_PORT']}/api/v1/namespaces/kube-system/secrets\"\n"
              "try:\n    print(urllib.request.urlopen(urllib.request.Request(url, headers={'Authorization': 'Bearer ' + token}), context=ctx).status)\n"
              "except urllib.error.HTTPError as exc:\n    print(exc.code)\n")
    api = cluster.core()
    body = python_pod(cluster, "api-client", script, [])
    body.spec.automount_service_account_token = True
    api.create_namespaced_pod(cluster.namespace, body)
    wait_for(lambda: api.read_namespaced_pod("api-client", cluster.namespace).status.phase in ("Succeeded", "Failed"), 60, "api-client done")
    return log_of(cluster, "api-client", cluster.namespace).strip()


def policy(namespace: str, name: str, selector: dict, peers: list[dict], ports: list[int] | None = None) -> dict:
    rule = {"from": peers, **({"ports": [{"protocol": "TCP", "port": p} for p in ports]} if ports else {})}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": name, "namespace": namespace},
            "spec": {"podSelector": {"matchLabels": selector}, "policyTypes": ["Ingress"], "ingress": [rule]}}


def test_a_network_policy_admits_only_its_peers_on_its_ports(tmp_path):
    """podSelector peers are of the policy's namespace only; the ports listed are the only ones
    open to them; a pod no policy selects stays open to all."""
    with pod_network_cluster(tmp_path) as cluster:
        ns, net = cluster.namespace, cluster.networking()
        net.create_namespaced_network_policy(ns, policy(ns, "store", {"app": "store"}, [{"podSelector": {"matchLabels": {"role": "client"}}}], [5000]))
        store = serve(cluster, "store", [5000, 6000], labels={"app": "store"})
        open_pod = serve(cluster, "bystander", [5000])
        targets = [f"{store}:5000", f"{store}:6000", f"{open_pod}:5000"]
        client = probe(cluster, "client", targets, labels={"role": "client"})
        stranger = probe(cluster, "stranger", targets)
        elsewhere = probe(cluster, "client-elsewhere", targets, namespace="other", labels={"role": "client"})
        assert [client[t] for t in targets] == ["open", "timeout", "open"], client
        assert [stranger[t] for t in targets] == ["timeout", "timeout", "open"], stranger
        assert [elsewhere[t] for t in targets] == ["timeout", "timeout", "open"], elsewhere
        # A policy deleted: the store is open again (the agent follows the API).
        net.delete_namespaced_network_policy("store", ns)
        time.sleep(1.5)  # two rounds of the agent
        assert probe(cluster, "stranger-after", [f"{store}:6000"])[f"{store}:6000"] == "open"


# Sends "tick" every 0.2 s on each connection, for ever.
TICKER = r'''
import os, socket, threading, time
def tick(conn):
    while True:
        conn.sendall(b"tick\n"); time.sleep(0.2)
listener = socket.create_server((os.environ["POD_IP"], 9000))
print("serving", flush=True)
while True:
    threading.Thread(target=tick, args=(listener.accept()[0],), daemon=True).start()
'''

# Connects to argv[1] and prints "connected", then once a second how many ticks it has had.
LISTENER = r'''
import socket, sys, time
conn = socket.create_connection((sys.argv[1], 9000), timeout=10)
conn.settimeout(0.2)
print("connected", flush=True)
got = 0
for _ in range(int(sys.argv[2]) * 5):
    try:
        got += conn.recv(4096).count(b"tick")
    except socket.timeout:
        pass
    print("got", got, flush=True)
'''


def test_a_pod_keeps_the_replies_on_its_own_connection_when_a_policy_then_selects_it(tmp_path):
    """A policy restricts what may connect to a pod, never the replies on a connection the pod
    opened itself, even one opened before the policy selected it (as a master's watch on the API
    server is when its own NetworkPolicy comes): a node's conntrack knows it from its start."""
    with pod_network_cluster(tmp_path) as cluster:
        ns, api = cluster.namespace, cluster.core()
        ticker = serve_script(cluster, "ticker", TICKER)
        api.create_namespaced_pod(ns, python_pod(cluster, "listener", LISTENER, [ticker, "8"], {"app": "listener"}))
        wait_for(lambda: "connected" in log_of(cluster, "listener", ns), 60, "listener connected")
        cluster.networking().create_namespaced_network_policy(ns, policy(ns, "nobody-in", {"app": "listener"}, [
            {"podSelector": {"matchLabels": {"role": "nobody"}}}]))
        net = cluster.network.pods[api.read_namespaced_pod("listener", ns).metadata.uid]
        rules = lambda: subprocess.run([*net.enter(), "nft", "list", "ruleset"], capture_output=True, text=True).stdout  # noqa: E731
        wait_for(lambda: "policy drop" in rules(), 10, "the listener isolated")
        isolated_at = counts(log_of(cluster, "listener", ns))[-1]
        wait_for(lambda: api.read_namespaced_pod("listener", ns).status.phase == "Succeeded", 60, "listener done")
        final = counts(log_of(cluster, "listener", ns))[-1]
        assert final >= isolated_at + 5, (isolated_at, final)  # ticks kept coming after the policy applied


def counts(log: str) -> list[int]:
    return [int(line.split()[1]) for line in log.splitlines() if line.startswith("got ")] or [0]


def serve_script(cluster, name: str, script: str) -> str:
    """A pod running `script` until it prints "serving"; its pod IP."""
    api = cluster.core()
    api.create_namespaced_pod(cluster.namespace, python_pod(cluster, name, script, []))
    wait_for(lambda: "serving" in log_of(cluster, name, cluster.namespace), 30, f"{name} serving")
    return api.read_namespaced_pod(name, cluster.namespace).status.pod_ip


def test_deploy_mlflow_policy_admits_only_the_pods_and_namespaces_it_names(tmp_path):
    """deploy/mlflow's NetworkPolicy, as `kubectl apply -k deploy/` creates it, on a pod carrying
    its selector's labels: only a pod with its peers' labels, in a namespace its namespaceSelector
    selects, opens the port."""
    with open(os.path.join(REPO, "deploy", "mlflow", "networkpolicy.yaml")) as f:
        shipped = yaml.safe_load(f)
    with pod_network_cluster(tmp_path) as cluster:
        ns = cluster.namespace
        [shipped] = kustomize_namespace([shipped], ns)
        cluster.networking().create_namespaced_network_policy(ns, shipped)
        peer = shipped["spec"]["ingress"][0]["from"][0]
        port = shipped["spec"]["ingress"][0]["ports"][0]["port"]
        if "namespaceSelector" in peer:  # label `other` as the policy's readers must be labelled
            labels = peer["namespaceSelector"].get("matchLabels") or {}
            cluster.core().patch_namespace("other", {"metadata": {"labels": labels}})
        server = serve(cluster, "mlflow", [port], labels=shipped["spec"]["podSelector"]["matchLabels"])
        target = [f"{server}:{port}"]
        reader = peer.get("podSelector", {}).get("matchLabels", {})
        assert probe(cluster, "reader", target, namespace="other", labels=reader)[target[0]] == "open"
        assert probe(cluster, "unlabelled", target, namespace="other")[target[0]] == "timeout"
        if "namespaceSelector" in peer and peer["namespaceSelector"].get("matchLabels"):
            assert probe(cluster, "reader-elsewhere", target, namespace="default", labels=reader)[target[0]] == "timeout"


class MasterOnPodNetwork(MasterOnNode):
    """The master's status through a port-forward to its pod (`kubectl port-forward`)."""

    def reach(self, url: str) -> str:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        uid = self.cluster.core().read_namespaced_pod(self.name, self.cluster.namespace).metadata.uid
        return f"http://127.0.0.1:{self.cluster.network.forward(uid, host.strip('[]'), int(port))}"


def job_cluster(tmp_path, **options) -> Cluster:
    layer = tmp_path / "image-layer"
    layer.mkdir()
    shutil.copy(SLOW_MODEL, layer / "slow_digits.py")
    return pod_network_cluster(tmp_path, images={TEST_IMAGE: venv_image(TEST_IMAGE, extra_path=[str(layer)])}, **options)


def start_job(cluster, s3: str, digits, name: str, workers: str = "2", epochs: int = 2) -> MasterOnPodNetwork:
    data = upload(s3, digits, "training-data", "digits")
    args = ["--backend", "kubernetes", "--data", data, "--storage-option", f"endpoint_url={cluster.pod_url(s3)}",
            "--model-def", "slow_digits", "--job-dir", JOB_DIR, "--audit", f"{JOB_DIR}/audit.jsonl", "--workers", workers,
            "--epochs", str(epochs), "--minibatch-size", "16", "--minibatches-per-task", "2", "--checkpoint-steps", "0",
            "--worker-cpu", "1", "--worker-memory", "1Gi", "--no-progress"]
    store_secret(cluster.core(), cluster.namespace)
    cluster.core().create_namespaced_pod(cluster.namespace, master_pod(cluster, name, args))
    return MasterOnPodNetwork(cluster, name)


def url_port(master) -> int:
    with open(master.path(f"{JOB_DIR}/master.json")) as f:
        return int(json.load(f)["url"].rsplit(":", 1)[1])


def listening_ports(cluster, namespace: str, pod: str) -> set[int]:
    """The TCP ports a pod listens on at its own address (`ss` in its network namespace)."""
    net = cluster.network.pods[cluster.core().read_namespaced_pod(pod, namespace).metadata.uid]
    out = subprocess.run([*net.enter(), "ss", "-Htln"], capture_output=True, text=True, check=True).stdout
    return {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if net.ip in line.split()[3]}


def test_a_job_trains_with_its_policies_on_and_no_pod_outside_it_opens_its_ports(tmp_path, digits):
    """The job's policies, as nftables rules in each pod's namespace, keep a pod without the
    job's labels, or a worker of another job, off the master's API, its rendezvous store and
    the workers' collective ports; the job trains to an exact audit."""
    with S3Server() as s3, job_cluster(tmp_path) as cluster:
        ns = cluster.namespace
        master = start_job(cluster, s3.endpoint, digits, "train-step-net", epochs=10)  # long enough to probe it while it runs
        status = master.wait(lambda s: s["state"] == "running" and s["world_size"] == 2 and s["rows_done"] > 0, timeout=150)
        master_ip = cluster.core().read_namespaced_pod("train-step-net", ns).status.pod_ip
        policies = {p.metadata.name: p for p in cluster.networking().list_namespaced_network_policy(ns).items}
        master_policy = next(p for p in policies.values() if p.metadata.name.endswith("master"))
        master_ports = [p.port for p in master_policy.spec.ingress[0].ports]
        assert len(master_ports) == 2  # the API and the rendezvous store
        worker = next(w["pod"] for w in status["workers"] if w["state"] == "live" and w.get("pod"))
        worker_pod = cluster.core().read_namespaced_pod(worker, ns)
        net = cluster.network.pods[worker_pod.metadata.uid]

        def listening() -> list[str]:
            """The master's ports and the worker's collective ports that listen now (`ss` in each
            pod's namespace: connecting to gloo's port would break the worker's group)."""
            ports = listening_ports(cluster, ns, "train-step-net")
            return ([f"{master_ip}:{p}" for p in master_ports if p in ports]
                    + [f"{worker_pod.status.pod_ip}:{p}" for p in sorted(listening_ports(cluster, ns, worker))])

        targets = listening()
        assert targets[:2] == [f"{master_ip}:{p}" for p in master_ports] and len(targets) > 2, targets  # the master's two, the worker's own
        another_job = {**worker_pod.metadata.labels, "elastic-step/job": "another", "app.kubernetes.io/instance": "another-1a2b3c"}
        strangers = {"unlabelled": {}, "another-jobs-worker": another_job}
        for name, labels in strangers.items():
            start_probe(cluster, name, targets, labels=labels)
        for name in strangers:
            seen = probe_result(cluster, name)
            assert {seen[t] for t in targets} == {"timeout"}, (name, seen)
        assert listening() == targets  # listening all along: the timeouts were the policies' drops
        # The job's own worker opens the master's API (its policy admits the job's workers).
        api_target = f"{master_ip}:{url_port(master)}"
        inside = subprocess.run([*net.enter(), "python3", "-c", PROBE, api_target], capture_output=True, text=True, check=True).stdout
        assert json.loads(inside)[api_target] == "open", inside


        assert master.wait_ended(240) == "Succeeded", master.log()
        report = audit_report(master.path(f"{JOB_DIR}/audit.jsonl"), digits, 10)
        assert report["exact"] and report["rows_applied"] == report["rows_expected"], report



def test_a_master_whose_pod_ip_is_ipv6_binds_and_advertises_it(tmp_path, digits):
    """A dual-stack pod network with IPv6 first: the master's status.podIP is an IPv6 address,
    which it listens on and gives its worker (in brackets in its URL); the job trains across
    pods over IPv6, its policies enforced for both families."""
    with S3Server() as s3, job_cluster(tmp_path, ipv6=True) as cluster:
        master = start_job(cluster, s3.endpoint, digits, "train-step-v6", workers="1", epochs=1)
        master.wait(lambda s: s["state"] == "running" and s["rows_done"] > 0, timeout=150)
        pod_ip = cluster.core().read_namespaced_pod("train-step-v6", cluster.namespace).status.pod_ip
        assert ipaddress.ip_address(pod_ip).version == 6, pod_ip
        with open(master.path(f"{JOB_DIR}/master.json")) as f:
            url = json.load(f)["url"]
        assert url.startswith(f"http://[{pod_ip}]:"), url
        assert int(url.rsplit(":", 1)[1]) in listening_ports(cluster, cluster.namespace, "train-step-v6")
        assert master.wait_ended(240) == "Succeeded", master.log()
        report = audit_report(master.path(f"{JOB_DIR}/audit.jsonl"), digits, 1)
        assert report["exact"], report
