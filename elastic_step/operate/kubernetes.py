"""Jobs on Kubernetes, read and steered with the caller's own credentials (kubeconfig or
in-cluster; deploy/operator's Role): a job's status ConfigMap, which its master keeps current
and takes a stop or scale request from, and its pods and their logs (statusmap.py, ps_scale.py,
pods.py)."""

from __future__ import annotations

from typing import Callable, Iterator

from elastic_step.errors import ElasticStepError
from elastic_step.operate.api import JobOperator, LivePage, LogRequest
from elastic_step.operate.pods import WORKER_CONTAINER, master_pod, pod_log, worker_pod
from elastic_step.operate.ps_scale import scale_ps_kubernetes
from elastic_step.operate.statusmap import (core_api, current_namespace, kubernetes_view, list_kubernetes, published_document,
                                            published_job, scale_kubernetes, status_map, stop_kubernetes, where_of)


class KubernetesJobs(JobOperator):
    def __init__(self, namespace: str | None = None, mlflow_uri: str | None = None, api=None):
        self.api = api or core_api()
        self.namespace = namespace or current_namespace()
        self.mlflow_uri = mlflow_uri

    def jobs(self) -> list[dict]:
        return [{**row, "where": f"{row['namespace']}/{row['instance']}"} for row in list_kubernetes(self.namespace, api=self.api)]

    def locate(self, job: str) -> str:
        """The running instance `job` names (so `top` keeps following that one), else `job` as
        given: a job that ended is found in MLflow by its name."""
        found = status_map(self.api, self.namespace, job)
        return (found.metadata.labels or {}).get("app.kubernetes.io/instance", job) if found is not None else job

    def view(self, job: str, with_events: bool = False) -> dict:
        return kubernetes_view(job, self.namespace, with_events, mlflow_uri=self.mlflow_uri, api=self.api)

    def stop(self, job: str, timeout_s: float, wait: bool, say: Callable[[str], None]) -> str:
        return stop_kubernetes(job, self.namespace, timeout_s, wait=wait, api=self.api)

    def scale(self, job: str, workers: int) -> str:
        return scale_kubernetes(job, self.namespace, workers, api=self.api)

    def scale_ps(self, job: str, shards: int) -> dict:
        return scale_ps_kubernetes(job, self.namespace, shards, api=self.api)

    def log_lines(self, job: str, request: LogRequest) -> Iterator[str]:
        if request.worker is None:
            pod, container = master_pod(self.api, self.namespace, job)
            previous = request.previous
        else:
            pod, previous = worker_pod(self.api, self.namespace, job, request.worker, request.previous)
            container = WORKER_CONTAINER
        yield from pod_log(self.api, self.namespace, pod, previous=previous, tail=request.tail, since_s=request.since_s,
                           timestamps=request.timestamps, follow=request.follow, container=container)

    def live_page(self, job: str) -> LivePage:
        found = status_map(self.api, self.namespace, job)
        if found is None:
            raise ElasticStepError(f"no running job {job!r} in namespace {self.namespace}; "
                                   "see `elastic-step list --backend kubernetes`")
        instance = (found.metadata.labels or {}).get("app.kubernetes.io/instance", job)

        def read() -> dict | None:
            current = status_map(self.api, self.namespace, instance)
            return published_document(current, self.namespace) if current is not None else None

        loaded = published_job(found, self.namespace)
        return LivePage(describe=f"job {loaded['info'].get('job', job)} ({where_of(loaded['info'])})", read=read)
