"""Jobs on Kubernetes, read and steered with the caller's own credentials (kubeconfig or
in-cluster; deploy/operator's Role): a job's status ConfigMap, which its master keeps current
and takes a stop request from, and its pods and their logs (elastic_step.kubejobs)."""

from __future__ import annotations

from typing import Callable, Iterator

from elastic_step.errors import ElasticStepError
from elastic_step.operate.api import JobOperator, LivePage, LogRequest


class KubernetesJobs(JobOperator):
    def __init__(self, namespace: str | None = None, mlflow_uri: str | None = None, api=None):
        from elastic_step import kubejobs

        self.api = api or kubejobs.core_api()
        self.namespace = namespace or kubejobs.current_namespace()
        self.mlflow_uri = mlflow_uri

    def jobs(self) -> list[dict]:
        from elastic_step.kubejobs import list_kubernetes

        return [{**row, "where": f"{row['namespace']}/{row['instance']}"} for row in list_kubernetes(self.namespace, api=self.api)]

    def locate(self, job: str) -> str:
        """The running instance `job` names (so `top` keeps following that one), else `job` as
        given: a job that ended is found in MLflow by its name."""
        from elastic_step.kubejobs import status_map

        found = status_map(self.api, self.namespace, job)
        return (found.metadata.labels or {}).get("app.kubernetes.io/instance", job) if found is not None else job

    def view(self, job: str, with_events: bool = False) -> dict:
        from elastic_step.kubejobs import kubernetes_view

        return kubernetes_view(job, self.namespace, with_events, mlflow_uri=self.mlflow_uri, api=self.api)

    def stop(self, job: str, timeout_s: float, wait: bool, say: Callable[[str], None]) -> str:
        from elastic_step.kubejobs import stop_kubernetes

        return stop_kubernetes(job, self.namespace, timeout_s, wait=wait, api=self.api)

    def scale(self, job: str, workers: int) -> str:
        from elastic_step.kubejobs import scale_kubernetes

        return scale_kubernetes(job, self.namespace, workers, api=self.api)

    def log_lines(self, job: str, request: LogRequest) -> Iterator[str]:
        from elastic_step.operate.pods import WORKER_CONTAINER, master_pod, pod_log, worker_pod

        if request.worker is None:
            pod, container = master_pod(self.api, self.namespace, job)
            previous = request.previous
        else:
            pod, previous = worker_pod(self.api, self.namespace, job, request.worker, request.previous)
            container = WORKER_CONTAINER
        yield from pod_log(self.api, self.namespace, pod, previous=previous, tail=request.tail, since_s=request.since_s,
                           timestamps=request.timestamps, follow=request.follow, container=container)

    def live_page(self, job: str) -> LivePage:
        from elastic_step.kubejobs import published_document, published_job, status_map, where_of

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
