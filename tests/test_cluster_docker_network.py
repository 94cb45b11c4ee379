"""The Docker runtime on the pod network: each pod a sandbox container started with no network
(`--network none`, as Kubernetes' pause container), the pod's veth and address moved into its
namespace, the pod's containers joining it (`--network container:`). The job trains across pods
of the image `make image-smoke` built, each on its own address, with its NetworkPolicies enforced
by nftables inside each container's namespace."""

from __future__ import annotations

import ipaddress
import json
import shutil
import subprocess

import pytest

from cluster import Cluster, Image
from cluster.network import available
from conftest import SLOW_MODEL
from elastic_step.audit import audit_report
from stores import S3Server
from test_cluster_e2e import JOB_DIR, TEST_IMAGE, docker_daemon  # noqa: F401 (a fixture)
from test_cluster_network import PROBE, probe_result, start_job, start_probe, url_port

pytestmark = pytest.mark.e2e


def test_a_job_trains_on_docker_pods_each_on_its_own_address_and_another_jobs_pod_cannot_open_the_master(tmp_path, digits, docker_daemon):  # noqa: F811
    from elastic_step.images import default_image

    if not available():
        pytest.fail("this node cannot make network namespaces (needs root, iproute2 and unshare --net)")
    layer = tmp_path / "image-layer"  # what a derived image adds: the model definition
    layer.mkdir()
    shutil.copy(SLOW_MODEL, layer / "slow_digits.py")
    layer.chmod(0o755)
    images = {TEST_IMAGE: Image(TEST_IMAGE, {"PYTHONPATH": "/image/layer0"}, layers={"/image/layer0": str(layer)}, docker=default_image()),
              default_image(): Image(default_image(), {}, docker=default_image())}
    with S3Server() as s3, Cluster(str(tmp_path / "cluster"), images=images, docker=docker_daemon, pod_network=True) as cluster:
        ns, api = cluster.namespace, cluster.core()
        master = start_job(cluster, s3.endpoint, digits, "train-step-docker", epochs=2)
        status = master.wait(lambda s: s["state"] == "running" and s["world_size"] == 2 and s["rows_done"] > 0, timeout=150)
        pods = [p for p in api.list_namespaced_pod(ns).items if p.status.phase == "Running"]
        addresses = {p.metadata.name: p.status.pod_ip for p in pods}
        workers = {w["pod"] for w in status["workers"] if w["state"] == "live"}
        assert workers <= set(addresses) and "train-step-docker" in addresses, (workers, addresses)
        assert len(set(addresses.values())) == len(addresses) >= 3, addresses  # the master and both workers, each its own
        assert all(ipaddress.ip_address(a) in ipaddress.ip_network("10.244.0.0/16") for a in addresses.values()), addresses
        # Each pod's address is its sandbox container's: the master's container sees it on its own eth0.
        container = cluster.kubelet.record(ns, "train-step-docker").containers[0].proc.container
        seen = subprocess.run(["docker", "exec", container, "cat", "/proc/net/fib_trie"], env=docker_daemon.env,
                              capture_output=True, text=True).stdout
        assert addresses["train-step-docker"] in seen, seen[-2000:]
        # Its first process is its command itself, PID 1 of its own PID namespace: no init added (no --init).
        first = subprocess.run(["docker", "exec", container, "cat", "/proc/1/cmdline"], env=docker_daemon.env,
                               capture_output=True, text=True).stdout.split("\0")
        names = [a.rsplit("/", 1)[-1] for a in first]  # the script, after its interpreter
        assert names[1:3] == ["elastic-step", "train"] or names[:2] == ["elastic-step", "train"], first
        # A pod with another job's labels cannot open the master's API; the job's own worker can.
        # Both are asked while the job surely runs: the other pod is started first (its start takes
        # seconds) and the worker is asked meanwhile; a short job may be over soon after.
        target = f"{addresses['train-step-docker']}:{url_port(master)}"
        worker = api.read_namespaced_pod(sorted(workers)[0], ns)
        another_job = {**worker.metadata.labels, "elastic-step/job": "another", "app.kubernetes.io/instance": "another-1a2b3c"}
        start_probe(cluster, "another-jobs-worker", [target], labels=another_job)
        net = cluster.network.pods[worker.metadata.uid]  # the worker's own namespace (its sandbox's), as the node names it
        inside = subprocess.run([*net.enter(), "python3", "-c", PROBE, target], capture_output=True, text=True, check=True).stdout
        assert json.loads(inside)[target] == "open", inside
        assert probe_result(cluster, "another-jobs-worker")[target] == "timeout"
        # ...and the master was still there to be refused: its pod still runs its job
        assert api.read_namespaced_pod("train-step-docker", ns).status.phase == "Running", "the job ended before the probe: lengthen it"
        assert master.wait_ended(240) == "Succeeded", master.log()
        report = audit_report(master.path(f"{JOB_DIR}/audit.jsonl"), digits, 2)
        assert report["exact"] and report["rows_applied"] == report["rows_expected"], report
    left = subprocess.run(["docker", "ps", "-aq", "--filter", "name=pod-"], env=docker_daemon.env, capture_output=True, text=True).stdout
    assert not left.strip(), left  # every container and pod sandbox removed with the cluster
