"""Release and expand back, as ElasticDL promised it: a job on the cluster stand-in loses two of
its three worker pods to a preemption while the node's capacity is taken by someone else; it
trains on with the one left, its replacements wait Pending (Unschedulable, in the scheduler's own
words) without ending the job or charging a relaunch, and once the capacity returns the
scheduler binds them and the job grows back to three, every row still applied exactly once.

The scheduler is tests/cluster/scheduling.py (kube-scheduler's NodeResourcesFit on the node's
allocatable); a preemption is what kube-scheduler's preemption or a drain does to a pod: a
graceful delete through the API, so the kubelet SIGTERMs the worker and it leaves."""

from __future__ import annotations

import json
import time

import pytest

from elastic_step.audit import audit_report
from stores import upload
from test_cluster_e2e import BUCKET, JOB_DIR, MasterOnNode, cluster, master_pod, s3, store_secret  # noqa: F401 (fixtures)

pytestmark = pytest.mark.e2e

ROOM_FOR_THREE = "3.5"  # the master asks 500m, each worker 1 cpu
ROOM_FOR_ONE = "1.5"


def live_workers(status: dict) -> list[dict]:
    return [w for w in status["workers"] if w["state"] == "live"]


def test_a_job_shrunk_by_preemptions_grows_back_when_capacity_returns(tmp_path, digits, s3, cluster):  # noqa: F811
    data = upload(s3, digits, BUCKET, "digits")
    epochs = 20
    args = ["--backend", "kubernetes", "--data", data, "--storage-option", f"endpoint_url={s3}",
            "--model-def", "slow_digits", "--job-dir", JOB_DIR, "--audit", f"{JOB_DIR}/audit.jsonl", "--workers", "1:3",
            "--epochs", str(epochs), "--minibatch-size", "16", "--minibatches-per-task", "2", "--heartbeat-timeout", "4",
            "--checkpoint-steps", "0", "--worker-cpu", "1", "--worker-memory", "1Gi", "--max-relaunches", "0",
            "--pending-timeout", "900", "--no-progress"]
    ns, api = cluster.namespace, cluster.core()
    cluster.set_allocatable(cpu=ROOM_FOR_THREE)
    store_secret(api, ns)
    api.create_namespaced_pod(ns, master_pod(cluster, "train-step-grow", args))
    master = MasterOnNode(cluster, "train-step-grow")
    status = master.wait(lambda s: s["state"] == "running" and s["world_size"] == 3
                         and 0.01 < s["rows_done"] / s["rows_total"] < 0.2, timeout=240)

    # Someone else takes the capacity; two workers are preempted (a graceful delete).
    cluster.set_allocatable(cpu=ROOM_FOR_ONE)
    victims = [w for w in live_workers(status) if w["rank"] != 0][:2]
    for victim in victims:
        api.delete_namespaced_pod(victim["pod"], ns, grace_period_seconds=10)
    shrunk = master.wait(lambda s: s["world_size"] == 1 and len(live_workers(s)) == 1, timeout=120)
    rows_shrunk = shrunk["rows_done"]
    # The replacements wait for room, Pending and Unschedulable, while the one worker trains on.
    def pending_replacements():
        pods = [p for p in api.list_namespaced_pod(ns, label_selector="app.kubernetes.io/component=worker").items
                if p.status.phase == "Pending"]
        return [p for p in pods if any(c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
                                       for c in (p.status.conditions or []))]
    deadline = time.monotonic() + 60
    while len(pending_replacements()) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    waiting = pending_replacements()
    assert len(waiting) == 2, [(p.metadata.name, p.status.phase, p.status.conditions) for p in
                               api.list_namespaced_pod(ns, label_selector="app.kubernetes.io/component=worker").items]
    assert "Insufficient cpu" in next(c.message for c in waiting[0].status.conditions if c.type == "PodScheduled")
    trained_on = master.wait(lambda s: s["rows_done"] > rows_shrunk + 64 and s["world_size"] == 1, timeout=120)
    assert trained_on["state"] == "running"

    # The capacity comes back: the scheduler binds the waiting pods and the job grows back.
    cluster.set_allocatable(cpu=ROOM_FOR_THREE)
    grown = master.wait(lambda s: s["world_size"] == 3, timeout=180)
    assert grown["rows_done"] < grown["rows_total"], "the job must grow back before it ends"

    assert master.wait_ended(300) == "Succeeded", master.log()
    report = audit_report(master.path(f"{JOB_DIR}/audit.jsonl"), digits, epochs)
    assert report["exact"] and report["rows_applied"] == report["rows_expected"], report
    with open(master.path(f"{JOB_DIR}/events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    relaunched = [e for e in events if e["event"] == "relaunched"]
    assert {e["worker"] for e in relaunched} == {v["id"] for v in victims}, relaunched
    assert not any(e["event"] == "not_relaunched" for e in events)  # --max-relaunches 0: none was charged
