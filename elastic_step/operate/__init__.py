"""Operating a running job from outside it: `get`, `list`, `top`, `logs`, `stop`, `scale` and
`ui` read and steer a job through what its master publishes (its job folder and API locally,
its status ConfigMap and pods on Kubernetes), checked against the protocol's models as read."""

from __future__ import annotations

import os

from elastic_step.operate.api import JobOperator, LivePage, LogRequest

BACKENDS = ("local", "kubernetes")

__all__ = ["BACKENDS", "JobOperator", "LivePage", "LogRequest", "backend_for", "operator_for"]


def backend_for(job: str | None, root: str | None = None) -> str:
    """The backend of job `job` when none is named: local for no job or a job folder here, else
    kubernetes where a cluster can be reached (a kubeconfig, or running in a pod)."""
    if not job:
        return "local"
    from elastic_step.operate.folder import UnknownJob, find_job

    try:
        find_job(job, root)
        return "local"
    except UnknownJob:
        pass
    has_kubeconfig = os.environ.get("KUBECONFIG") or os.path.exists(os.path.expanduser("~/.kube/config"))
    return "kubernetes" if has_kubeconfig or os.environ.get("KUBERNETES_SERVICE_HOST") else "local"


def operator_for(backend: str, root: str | None = None, namespace: str | None = None,
                 mlflow_uri: str | None = None) -> JobOperator:
    """The jobs of `backend`: job folders under `root` (local), or those of `namespace`
    (kubernetes; `mlflow_uri` finds the ones that ended)."""
    if backend == "kubernetes":
        from elastic_step.operate.kubernetes import KubernetesJobs

        return KubernetesJobs(namespace, mlflow_uri)
    from elastic_step.operate.local import LocalJobs

    return LocalJobs(root)
