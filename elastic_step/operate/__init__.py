"""Operating a running job from outside it: `get`, `list`, `top`, `logs`, `stop`, `scale` and
`ui` read and steer a job through what its master publishes (its job folder and API locally,
its status ConfigMap and pods on Kubernetes), checked against the protocol's models as read."""

from __future__ import annotations

from elastic_step.operate.api import JobOperator, LivePage, LogRequest

BACKENDS = ("local", "kubernetes")

__all__ = ["BACKENDS", "JobOperator", "LivePage", "LogRequest", "operator_for"]


def operator_for(backend: str, root: str | None = None, namespace: str | None = None,
                 mlflow_uri: str | None = None) -> JobOperator:
    """The jobs of `backend`: job folders under `root` (local), or those of `namespace`
    (kubernetes; `mlflow_uri` finds the ones that ended)."""
    if backend == "kubernetes":
        from elastic_step.operate.kubernetes import KubernetesJobs

        return KubernetesJobs(namespace, mlflow_uri)
    from elastic_step.operate.local import LocalJobs

    return LocalJobs(root)
