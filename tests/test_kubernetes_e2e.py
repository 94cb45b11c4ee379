"""Master + Kubernetes backend + real worker processes, end to end on digits. What stands in for
the API server is tests/kube_fake.py: a fake CoreV1Api whose pods run as local processes with
the pod's command and env, the token Secret written to a folder standing in for its volume.
The master runs in this process (the fake lives here too); the test acts on the "cluster"
from a thread beside it."""

from __future__ import annotations

import base64
import os
import threading
import time

import mlflow
import pytest

from elastic_step.audit import audit_report
from elastic_step.config import TrainConfig
from elastic_step.errors import JobFailed
from elastic_step.operate.client import JobClient, read_master_info, try_status
from elastic_step.master.job import run_job

from conftest import SLOW_MODEL
from kube_fake import FakeCoreV1Api

pytestmark = pytest.mark.e2e

MASTER_IMAGE = "registry.example/ml/elastic-step-torch:0.1.0"


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    fake = FakeCoreV1Api(str(tmp_path / "cluster"))
    master = fake.add_master_pod("train-step-7f9c", MASTER_IMAGE)
    monkeypatch.setattr("elastic_step.backends.kubernetes.client.load_core_api", lambda: fake)
    # The downward API of the master's pod, as deploy/examples sets it.
    monkeypatch.setenv("ELASTIC_STEP_POD_NAME", master.metadata.name)
    monkeypatch.setenv("ELASTIC_STEP_POD_UID", master.metadata.uid)
    monkeypatch.setenv("ELASTIC_STEP_POD_IP", "127.0.0.1")
    monkeypatch.setenv("ELASTIC_STEP_POD_NAMESPACE", "ml")
    tracking_uri = mlflow.get_tracking_uri()
    yield fake
    fake.close()
    mlflow.set_tracking_uri(tracking_uri)


def config(tmp_path, digits, **overrides) -> TrainConfig:
    options = dict(model_def=SLOW_MODEL, data=digits, job_dir=str(tmp_path / "job"), workers="2:3", epochs=2,
                   minibatch_size=16, minibatches_per_task=2, heartbeat_timeout=4.0, backend="kubernetes",
                   progress=False, checkpoint_steps=0, worker_memory="1Gi", worker_cpu="1")
    options.update(overrides)
    return TrainConfig(audit=str(tmp_path / "audit.jsonl"), **options)


def run_master(cfg: TrainConfig, act=None):
    """The master in this (main) thread, as `elastic-step train` runs it; `act(status_fn)` beside it."""
    failures = []

    def actor():
        try:
            act(lambda predicate, timeout=120: wait_status(cfg.job_dir, predicate, timeout))
        except BaseException as exc:  # reported after the job, with the job's own outcome
            failures.append(exc)

    thread = threading.Thread(target=actor, daemon=True) if act else None
    if thread:
        thread.start()
    try:
        return run_job(cfg)
    finally:
        if thread:
            thread.join(30)
        if failures:
            raise failures[0]


def wait_status(job_dir, predicate, timeout):
    deadline = time.monotonic() + timeout
    status = None
    while time.monotonic() < deadline:
        status = try_status(job_dir)
        if status is not None and predicate(status):
            return status
        time.sleep(0.05)
    raise AssertionError(f"condition not reached in {timeout}s; last status {status}")


def mid_epoch(s, world=3):
    return s["state"] == "running" and s["world_size"] == world and 0.15 < s["rows_done"] / s["rows_total"] < 0.6


def events(cfg):
    import json

    with open(os.path.join(cfg.job_dir, "events.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_train_on_pods_deleting_one_mid_epoch_relaunches_it_free_and_the_audit_is_exact(tmp_path, digits, cluster):
    # --max-relaunches 0: only a free relaunch (the cluster's doing, not the worker's) can refill the slot.
    cfg = config(tmp_path, digits, epochs=3, max_relaunches=0)
    victim = {}

    def act(wait):
        status = wait(mid_epoch)
        worker = next(w for w in status["workers"] if w["rank"] == 1)
        victim.update(worker)
        victim["api_url"] = read_master_info(cfg.job_dir)["url"]  # now: the master removes master.json as it exits
        cluster.compact()  # the API server drops its watch history too: the backend must re-list
        cluster.delete_namespaced_pod(worker["pod"], "ml")  # `kubectl delete pod`, by someone else
        wait(lambda s: s["world_size"] == 3 and any(w["slot"] == worker["slot"] and w["id"] != worker["id"]
                                                    and w["rows_applied"] > 0 for w in s["workers"]))

    result = run_master(cfg, act)
    report = audit_report(cfg.audit, digits, cfg.epochs)
    assert report["exact"] and report["rows_applied"] == report["rows_expected"] == result.rows_audited, report
    assert result.test_metrics["accuracy"] >= 0.9, result.test_metrics
    log = events(cfg)
    # The pod keeps its grace period: the worker leaves on the kubelet's SIGTERM, a departure.
    gone = [e for e in log if e["event"] in ("died", "left")]
    assert [(e["event"], e["worker"]) for e in gone] == [("left", victim["id"])], gone
    assert "deleted by someone else" in gone[0]["reason"] and "left on SIGTERM" in gone[0]["reason"]
    assert any(e["event"] == "relaunched" and e["worker"] == victim["id"] for e in log)
    assert not [e for e in log if e["event"] == "slot_exhausted"]
    lists = [c for c in cluster.calls if c[0] == "list"]
    assert len(lists) >= 2, cluster.calls  # the first list, and the re-list after 410 Gone
    resumed = [int(rv) for kind, rv in cluster.calls if kind == "watch"]
    assert resumed and resumed == sorted(resumed) and min(resumed) > 0  # every watch resumes from a resourceVersion

    # What the pods were: the master's own image, owned by the master pod, the token only in the Secret.
    token = open(os.path.join(cfg.job_dir, "token")).read().strip()
    created = cluster.created
    assert len(created) == 4  # 3 workers and the replacement
    replacement = created[-1]
    assert replacement.metadata.labels["elastic-step/replica-index"] == str(victim["slot"])
    master = cluster.read_namespaced_pod("train-step-7f9c", "ml")
    from kubernetes import client as k8s
    import kubernetes_validate

    for pod in created:
        kubernetes_validate.validate(k8s.ApiClient().sanitize_for_serialization(pod),
                                     kubernetes_validate.utils.latest_version(), strict=True)
        container = pod.spec.containers[0]
        assert container.image == MASTER_IMAGE and container.command == ["elastic-step", "worker"]
        assert pod.metadata.owner_references[0].uid == master.metadata.uid
        assert pod.metadata.labels["app.kubernetes.io/component"] == "worker"
        assert pod.metadata.labels["elastic-step/job"] == "job"
        assert all(token not in (e.value or "") for e in container.env) and token not in " ".join(container.command)
        assert container.resources.limits == {"cpu": "1", "memory": "1Gi"}
    # The job's end deletes every pod, the Secret and the NetworkPolicies.
    assert cluster.wait_until_no_worker_pods() == {} and cluster.secrets == {} and cluster.network_policies == {}
    # The master's pod admits the job's workers on exactly its two ports: the API and the store.
    import json
    from urllib.parse import urlparse

    api_port = urlparse(victim["api_url"]).port
    master_policy = next(p for p in cluster.created_network_policies if p.metadata.name.endswith("-master"))
    ports = [p.port for p in master_policy.spec.ingress[0].ports]
    assert len(ports) == 2 and api_port in ports, ports
    assert master_policy.spec.pod_selector.match_labels == {"workflows.argoproj.io/workflow": "train-wf"}
    created_secret = [c for c in cluster.calls if c[0] == "create_secret"]
    assert len(created_secret) == 1 and ("delete_secret", created_secret[0][1]) in cluster.calls


def test_an_oom_killed_worker_is_not_relaunched_and_the_job_says_which_and_its_limit(tmp_path, digits, cluster):
    cfg = config(tmp_path, digits, workers="2", epochs=4, worker_memory="768Mi")

    def act(wait):
        status = wait(lambda s: mid_epoch(s, world=2))
        cluster.oom_kill(next(w["pod"] for w in status["workers"] if w["rank"] == 1))

    with pytest.raises(JobFailed) as failed:
        run_master(cfg, act)
    message = str(failed.value)
    assert "OOMKilled" in message and "768Mi" in message and "-w1-1" in message, message
    assert not [e for e in events(cfg) if e["event"] == "relaunched"]
    assert cluster.wait_until_no_worker_pods() == {} and cluster.secrets == {}


def test_scale_in_from_three_to_two_deletes_the_highest_index_pod(tmp_path, digits, cluster):
    cfg = config(tmp_path, digits, epochs=2)
    seen = {}

    def act(wait):
        wait(lambda s: s["world_size"] == 3 and s["rows_done"] > 0)
        client = JobClient(cfg.job_dir)
        client.scale(2)
        client.close()
        wait(lambda s: s["world_size"] == 2 and s["round_ready"])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(cluster.worker_pods()) != 2:
            time.sleep(0.05)
        seen["indexes"] = sorted(r.pod.metadata.labels["elastic-step/replica-index"] for r in cluster.worker_pods().values())

    result = run_master(cfg, act)
    assert seen["indexes"] == ["0", "1"]
    assert ("delete_pod", cluster.pod_of("w2.1")) in cluster.calls
    report = audit_report(cfg.audit, digits, cfg.epochs)
    assert report["exact"] and result.rows_audited == report["rows_expected"], report
    assert not [e for e in events(cfg) if e["event"] in ("died", "relaunched")]


def test_an_image_that_cannot_be_pulled_fails_the_job_naming_pod_and_cause(tmp_path, digits, cluster):
    cluster.missing_images.add("registry.example/ml/typo:0.1.0")
    cfg = config(tmp_path, digits, workers="2", image="registry.example/ml/typo:0.1.0", pending_timeout=1.5)
    started = time.monotonic()
    with pytest.raises(JobFailed) as failed:
        run_master(cfg)
    message = str(failed.value)
    assert "could not pull image 'registry.example/ml/typo:0.1.0'" in message and "ErrImagePull" in message
    assert "-w0-1" in message or "-w1-1" in message, message  # the first pod to time out ends the job
    assert time.monotonic() - started < 60
    assert cluster.wait_until_no_worker_pods() == {} and cluster.secrets == {}
