"""`list --backend kubernetes` and `logs --backend kubernetes`: jobs found by their worker pods'
labels, a worker's log read through pods/log with the caller's own credentials (the master's Role
is not involved), against a stand-in CoreV1Api that keeps real V1Pod objects."""

from __future__ import annotations

import datetime

import pytest
from kubernetes import client as k8s

from elastic_step.backends.kubernetes.manifests import JobNames
from elastic_step.errors import ElasticStepError
from elastic_step.operate.statusmap import list_kubernetes
from elastic_step.operate import LogRequest
from elastic_step.operate.kubernetes import KubernetesJobs
from elastic_step.operate.pods import worker_pod

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)


class PodsApi:
    def __init__(self):
        self.pods: list[k8s.V1Pod] = []
        self.logs: dict[tuple[str, bool], str] = {}
        self.calls: list[dict] = []

    def add(self, job: str, instance: str, worker_id: str, phase: str, minute: int) -> str:
        names = JobNames(job, instance)
        slot, attempt = worker_id[1:].split(".")
        labels = {**names.labels("worker"), "elastic-step/replica-index": slot, "elastic-step/worker-id": f"w{slot}-{attempt}"}
        name = f"{instance}-w{slot}-{attempt}"
        self.pods.append(k8s.V1Pod(metadata=k8s.V1ObjectMeta(name=name, labels=labels,
                                                             creation_timestamp=T0 + datetime.timedelta(minutes=minute)),
                                   status=k8s.V1PodStatus(phase=phase)))
        return name

    def list_namespaced_pod(self, namespace, label_selector=None, **kwargs):
        wanted = dict(part.split("=") for part in (label_selector or "").split(",") if part)
        return k8s.V1PodList(items=[p for p in self.pods if all(p.metadata.labels.get(k) == v for k, v in wanted.items())])

    def list_namespaced_config_map(self, namespace, label_selector=None, **kwargs):
        return k8s.V1ConfigMapList(items=[])  # no job publishes its status here: none is running

    def read_namespaced_pod_log(self, name, namespace, container=None, previous=False, **kwargs):
        self.calls.append({"name": name, "container": container, "previous": previous, **kwargs})
        if (name, previous) not in self.logs:
            raise k8s.ApiException(status=400, reason="previous terminated container not found")
        return self.logs[(name, previous)]


@pytest.fixture
def api():
    api = PodsApi()
    api.add("digits", "digits-abc", "w0.1", "Running", 0)
    api.add("digits", "digits-abc", "w1.1", "Failed", 0)
    api.add("digits", "digits-abc", "w1.2", "Running", 3)
    api.add("iris", "iris-xyz", "w0.1", "Pending", 5)
    return api


def test_list_finds_jobs_by_their_worker_pods_labels(api):
    rows = list_kubernetes("ml", api=api)
    assert [(r["job"], r["state"], r["workers_live"], r["target_workers"]) for r in rows] == [
        ("digits", "running", 2, 3), ("iris", "pending", 0, 1)]


def test_a_worker_or_its_slot_or_its_earlier_attempt_names_a_pod(api):
    assert worker_pod(api, "ml", "digits", "w1", False) == ("digits-abc-w1-2", False)
    assert worker_pod(api, "ml", "digits", "w1.1", False) == ("digits-abc-w1-1", False)
    assert worker_pod(api, "ml", "digits", "w1", True) == ("digits-abc-w1-1", False)  # the relaunched slot's earlier pod
    assert worker_pod(api, "ml", "digits", "w0", True) == ("digits-abc-w0-1", True)  # else the pod's earlier container
    assert worker_pod(api, "ml", "digits-abc", "w0", False) == ("digits-abc-w0-1", False)  # by instance too
    with pytest.raises(ElasticStepError, match="no worker pods of job 'nope'"):
        worker_pod(api, "ml", "nope", "w0", False)
    with pytest.raises(ElasticStepError, match="no pod of worker w1.7"):
        worker_pod(api, "ml", "digits", "w1.7", False)


def log_lines(api, **request) -> list[str]:
    """`elastic-step logs digits --backend kubernetes ...`, as the CLI asks for it."""
    return list(KubernetesJobs("ml", api=api).log_lines("digits", LogRequest(**request)))


def test_logs_reads_pods_log_with_tail_since_and_timestamps(api):
    api.logs[("digits-abc-w1-1", False)] = "started\nTraceback (most recent call last):\nKilled\n"
    assert log_lines(api, worker="w1", previous=True, tail=2, timestamps=True, since_s=300) == [
        "started", "Traceback (most recent call last):", "Killed"]
    assert api.calls[-1] == {"name": "digits-abc-w1-1", "container": "worker", "previous": False, "timestamps": True,
                             "tail_lines": 2, "since_seconds": 300}
    with pytest.raises(ElasticStepError, match="no earlier container"):
        log_lines(api, worker="w0", previous=True)
    with pytest.raises(ElasticStepError, match="no running job 'digits' with a master pod.*kubectl logs"):
        log_lines(api, worker=None)
