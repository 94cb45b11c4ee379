"""Creating a submission's objects, and `delete`: everything of a job, found by its label.

Order matters for "nothing half-made": the ConfigMap first (the pod mounts it), then the pod; if
the pod is refused, the ConfigMap goes again. Once the pod exists the ConfigMap is given it as
owner, so deleting the master pod (as `kubectl delete pod` does) takes it along, as it takes the
workers, their Secret and NetworkPolicies, which the master owns."""

from __future__ import annotations

import time

from kubernetes import client as k8s

from elastic_step.errors import ElasticStepError, JobFailed
from elastic_step.submit.spec import JOB_LABEL, Submission, model_config_map, master_pod

# Every kind a job makes: the master pod and the model's ConfigMap (submit), the worker pods,
# token Secret, status ConfigMap and NetworkPolicies (the master), all labelled with the job.
CORE_KINDS = ("pod", "config_map", "secret")


class ClusterRefused(ElasticStepError):
    """The API server refused what the checks let through (admission, a quota, a race)."""

    exit_code = JobFailed.exit_code


def _refused(what: str, namespace: str, exc: k8s.ApiException) -> ElasticStepError:
    return ClusterRefused(f"cannot create {what} in namespace {namespace}: {exc.status} {exc.reason}"
                            f"{': ' + exc.body.strip() if exc.status == 422 and exc.body else ''}; nothing was left behind")


def create(api_client, sub: Submission) -> str:
    """Creates the job; returns the master pod's UID."""
    core = k8s.CoreV1Api(api_client)
    if sub.model_file:
        try:
            core.create_namespaced_config_map(sub.namespace, model_config_map(sub))
        except k8s.ApiException as exc:
            raise _refused(f"ConfigMap {sub.config_map_name}", sub.namespace, exc) from None
    try:
        pod = core.create_namespaced_pod(sub.namespace, master_pod(sub))
    except k8s.ApiException as exc:
        if sub.model_file:
            core.delete_namespaced_config_map(sub.config_map_name, sub.namespace)
        raise _refused(f"pod {sub.pod_name}", sub.namespace, exc) from None
    if sub.model_file:
        owner = k8s.V1OwnerReference(api_version="v1", kind="Pod", name=pod.metadata.name, uid=pod.metadata.uid)
        core.patch_namespaced_config_map(sub.config_map_name, sub.namespace,
                                         {"metadata": {"ownerReferences": [api_client.sanitize_for_serialization(owner)]}})
    return pod.metadata.uid


def _listed(core: k8s.CoreV1Api, networking: k8s.NetworkingV1Api, namespace: str, job: str) -> list[tuple[str, str]]:
    selector = f"{JOB_LABEL}={job}"
    found = [(kind, o.metadata.name) for kind in CORE_KINDS
             for o in getattr(core, f"list_namespaced_{kind}")(namespace, label_selector=selector).items]
    found += [("network_policy", o.metadata.name)
              for o in networking.list_namespaced_network_policy(namespace, label_selector=selector).items]
    return found


def delete_job(api_client, namespace: str, job: str, timeout_s: float = 60.0) -> list[str]:
    """Deletes every object labelled with the job and waits until none is left; returns what was
    deleted. A running master gets its grace period (a checkpoint) and may relaunch a worker it
    sees deleted meanwhile: each pass deletes what is new, until nothing carries the label."""
    core, networking = k8s.CoreV1Api(api_client), k8s.NetworkingV1Api(api_client)
    deleted: list[tuple[str, str]] = []
    deadline = time.monotonic() + timeout_s
    try:
        while found := _listed(core, networking, namespace, job):
            if time.monotonic() > deadline:
                left = ", ".join(f"{k.replace('_', '')} {n}" for k, n in found)
                raise ClusterRefused(f"job {job}: still there after {timeout_s:.0f}s: {left}; run delete again")
            for kind, name in [f for f in found if f not in deleted]:
                _delete(core, networking, kind, name, namespace)
                deleted.append((kind, name))
            time.sleep(0.5)
    except k8s.ApiException as exc:
        raise ElasticStepError(f"cannot delete job {job} in namespace {namespace}: {exc.status} {exc.reason}; you "
                               "need to list and delete pods, configmaps, secrets and networkpolicies there") from None
    if not deleted:
        raise ElasticStepError(f"no job {job} in namespace {namespace}: nothing carries the label {JOB_LABEL}={job}")
    return [f"{kind.replace('_', '')} {name}" for kind, name in deleted]


def _delete(core, networking, kind: str, name: str, namespace: str) -> None:
    api = networking if kind == "network_policy" else core
    try:
        getattr(api, f"delete_namespaced_{kind}")(name, namespace)
    except k8s.ApiException as exc:
        if exc.status != 404:  # gone already: its owner's garbage collection was first
            raise
