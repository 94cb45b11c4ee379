"""Pods in PID namespaces of their own (the namespaces runtime, tests/cluster/podinit.py; Docker
gives its own): a container's first process is PID 1 with no init added, as in a plain image, it
sees its own processes only, so no pod reads another's environment; and the project's processes
as PID 1 handle the kubelet's SIGTERM within the grace period (PID 1 gets no signal it does not
handle): a worker leaves, its rows going back to the queue, and a master exits with the
preempted code."""

from __future__ import annotations

import json
import shutil
import signal
import time

import pytest
from kubernetes import client as k8s

from cluster import Cluster, venv_image
from cluster.runtime import can_isolate, container_pid
from conftest import SLOW_MODEL
from elastic_step.audit import audit_report
from elastic_step.exit_codes import ExitCode
from elastic_step.protocol import WORKER_LEFT_EXIT_CODE
from stores import S3Server, upload
from test_cluster_e2e import JOB_DIR, TEST_IMAGE, MasterOnNode, master_pod, store_secret

pytestmark = pytest.mark.e2e

# What a container sees of processes: its PID, every PID in its /proc, and which environments
# it could read there holding the other pod's secret.
LOOK = r'''
import json, os, sys
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
leaked = []
for pid in pids + [int(sys.argv[1])]:
    try:
        if b"s3cr3t-of-the-holder" in open(f"/proc/{pid}/environ", "rb").read():
            leaked.append(pid)
    except OSError:
        pass
print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "pids": pids, "leaked": leaked}))
'''


def namespaces_cluster(tmp_path, **options) -> Cluster:
    if not can_isolate():
        pytest.fail("this node cannot make namespaces (needs root and unshare)")
    return Cluster(str(tmp_path / "cluster"), **options)


def wait_phase(api, name: str, namespace: str, phases=("Succeeded", "Failed"), timeout: float = 60) -> k8s.V1Pod:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pod = api.read_namespaced_pod(name, namespace)
        if pod.status.phase in phases:
            return pod
        time.sleep(0.1)
    raise AssertionError(f"pod {name} not {phases} in {timeout}s")


def test_a_containers_first_process_is_pid_1_and_no_pod_reads_another_pods_environment(tmp_path):
    with namespaces_cluster(tmp_path) as cluster:
        api, ns = cluster.core(), cluster.namespace
        api.create_namespaced_pod(ns, k8s.V1Pod(
            metadata=k8s.V1ObjectMeta(name="holder"),
            spec=k8s.V1PodSpec(restart_policy="Never", termination_grace_period_seconds=1, containers=[k8s.V1Container(
                name="main", image=cluster.project_image, command=["python", "-c", "print('up', flush=True); import time; time.sleep(600)"],
                env=[k8s.V1EnvVar(name="AWS_SECRET_ACCESS_KEY", value="s3cr3t-of-the-holder")])])))
        wait_phase(api, "holder", ns, ("Running",))
        deadline = time.monotonic() + 30
        while b"up" not in api.read_namespaced_pod_log("holder", ns, _preload_content=False).data and time.monotonic() < deadline:
            time.sleep(0.1)  # its command runs (podinit has become it)
        holder = cluster.kubelet.record(ns, "holder").containers[0]
        node_pid = container_pid(holder.proc)  # the holder's PID 1 as the node numbers it
        with open(f"/proc/{node_pid}/environ", "rb") as f:
            assert b"s3cr3t-of-the-holder" in f.read()  # the node sees it: the secret is there to find
        api.create_namespaced_pod(ns, k8s.V1Pod(
            metadata=k8s.V1ObjectMeta(name="looker"),
            spec=k8s.V1PodSpec(restart_policy="Never", containers=[k8s.V1Container(
                name="main", image=cluster.project_image, command=["python", "-c", LOOK, str(node_pid)])])))
        done = wait_phase(api, "looker", ns)
        out = api.read_namespaced_pod_log("looker", ns, _preload_content=False).data.decode()
        assert done.status.phase == "Succeeded", out
        seen = json.loads(out.strip().splitlines()[-1])
        assert seen["pid"] == 1 and seen["ppid"] == 0, seen  # its command is PID 1, with nothing above it
        assert seen["pids"] == [1], seen  # only its own process: no init, no other pod's
        assert seen["leaked"] == [], seen


def job_cluster(tmp_path) -> Cluster:
    layer = tmp_path / "image-layer"
    layer.mkdir()
    shutil.copy(SLOW_MODEL, layer / "slow_digits.py")
    return namespaces_cluster(tmp_path, images={TEST_IMAGE: venv_image(TEST_IMAGE, extra_path=[str(layer)])})


def start_job(cluster, s3: str, digits, name: str, workers: str, epochs: int) -> MasterOnNode:
    api, ns = cluster.core(), cluster.namespace
    store_secret(api, ns)
    data = upload(s3, digits, "training-data", "digits")
    args = ["--backend", "kubernetes", "--data", data, "--storage-option", f"endpoint_url={s3}", "--model-def", "slow_digits",
            "--job-dir", JOB_DIR, "--audit", f"{JOB_DIR}/audit.jsonl", "--workers", workers, "--epochs", str(epochs),
            "--minibatch-size", "16", "--minibatches-per-task", "2", "--checkpoint-steps", "0", "--worker-cpu", "1",
            "--worker-memory", "1Gi", "--no-progress"]
    api.create_namespaced_pod(ns, master_pod(cluster, name, args))
    return MasterOnNode(cluster, name)


def test_a_worker_as_pid_1_leaves_on_sigterm_and_its_rows_go_back_to_the_queue(tmp_path, digits):
    """The runtime's SIGTERM (`docker kill --signal TERM`, an eviction's first step) reaches a
    worker as PID 1 through its own handler: it leaves at once (exit 143, an event `left`, not
    `died`), and its rows go back to the queue (the job ends with an exact audit). The signal alone
    shows PID 1's part; a pod deleted through the API gets the same SIGTERM from the kubelet and
    keeps its grace period (the backend's "being deleted by someone else")."""
    with S3Server() as s3, job_cluster(tmp_path) as cluster:
        ns = cluster.namespace
        master = start_job(cluster, s3.endpoint, digits, "train-step-term", "2", 2)
        status = master.wait(lambda s: s["state"] == "running" and s["world_size"] == 2 and s["rows_done"] > 0, timeout=150)
        leaver = next(w for w in status["workers"] if w["state"] == "live" and w.get("pod"))
        record = cluster.kubelet.record(ns, leaver["pod"])
        signalled_at = time.monotonic()
        cluster.kubelet.kill(ns, leaver["pod"], signal.SIGTERM)
        while record.containers[0].exit is None and time.monotonic() - signalled_at < 30:
            time.sleep(0.05)
        took = time.monotonic() - signalled_at
        assert record.containers[0].exit is not None and record.containers[0].exit[0] == WORKER_LEFT_EXIT_CODE, record.containers[0].exit
        assert took < 10, f"the worker took {took:.1f}s of a 30s grace to leave"
        print(f"worker left {took:.2f}s after SIGTERM")
        assert master.wait_ended(240) == "Succeeded", master.log()
        with open(master.path(f"{JOB_DIR}/events.jsonl")) as f:
            events = [json.loads(line) for line in f]
        assert any(e["event"] == "left" and e["worker"] == leaver["id"] for e in events), events
        assert not any(e["event"] == "died" and e["worker"] == leaver["id"] for e in events), events
        report = audit_report(master.path(f"{JOB_DIR}/audit.jsonl"), digits, 2)
        assert report["exact"] and report["rows_applied"] == report["rows_expected"], report


def test_a_master_as_pid_1_exits_preempted_within_its_grace_period(tmp_path, digits):
    """The kubelet's SIGTERM on a graceful deletion of the master's pod (30 s grace) reaches PID 1
    only through its own handler: the master exits 75 (preempted), well within the grace."""
    with S3Server() as s3, job_cluster(tmp_path) as cluster:
        api, ns = cluster.core(), cluster.namespace
        preempted = start_job(cluster, s3.endpoint, digits, "train-step-preempted", "1", 20)
        preempted.wait(lambda s: s["state"] == "running", timeout=150)
        deleted_at = time.monotonic()
        api.delete_namespaced_pod("train-step-preempted", ns)
        record = cluster.kubelet.record(ns, "train-step-preempted")
        while record.containers[0].exit is None and time.monotonic() - deleted_at < 35:
            time.sleep(0.05)
        took = time.monotonic() - deleted_at
        assert record.containers[0].exit is not None and record.containers[0].exit[0] == ExitCode.PREEMPTED, \
            (record.containers[0].exit, open(record.containers[0].log_path).read()[-3000:])
        assert took < 25, f"the master took {took:.1f}s of its 30s grace"
        print(f"master exited {int(ExitCode.PREEMPTED)} {took:.2f}s after its pod's deletion")
