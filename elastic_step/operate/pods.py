"""The pods of a job on Kubernetes and their logs, as `elastic-step logs --backend kubernetes`
reads them with the caller's own credentials (pods/log; the master's Role is not involved): a
worker's pod by id or slot, its earlier attempt, and the master's pod."""

from __future__ import annotations

import re

from elastic_step.backends.kubernetes.manifests import dns_label
from elastic_step.errors import ElasticStepError
from elastic_step.operate.statusmap import WORKER_SELECTOR, AmbiguousJob, created_at, instance_of, master_pod_of, status_map

WORKER_CONTAINER = "worker"


def worker_pod(api, namespace: str, job: str, worker: str | None, previous: bool) -> tuple[str, bool]:
    """The pod of a job's worker (`w1.2`, or `w1`: the slot's newest attempt), and whether to
    read its previous container. `previous`: the slot's earlier attempt's pod where it is still
    there, else the previous container of the same pod."""
    pods = [p for p in api.list_namespaced_pod(namespace, label_selector=WORKER_SELECTOR).items
            if job in ((p.metadata.labels or {}).get("elastic-step/job"), (p.metadata.labels or {}).get("app.kubernetes.io/instance"))]
    if not pods:
        raise ElasticStepError(f"no worker pods of job {job!r} in namespace {namespace}; see `elastic-step list --backend kubernetes`")
    pods = _one_instance(api, namespace, job, pods)
    match = re.match(r"^w?(\d+)(?:\.(\d+))?$", worker or "w0")
    if not match:
        raise ElasticStepError(f"--worker {worker!r} names no worker; use an id (w1.2) or a slot (w1)")
    slot = [p for p in pods if (p.metadata.labels or {}).get("elastic-step/replica-index") == match.group(1)]
    slot.sort(key=created_at)
    if not slot:
        raise ElasticStepError(f"job {job!r} has no worker pod of slot w{match.group(1)}")
    chosen = slot[-1]
    if match.group(2):
        wanted = f"w{match.group(1)}-{match.group(2)}"
        named = [p for p in slot if (p.metadata.labels or {}).get("elastic-step/worker-id") == wanted]
        if not named:
            raise ElasticStepError(f"no pod of worker w{match.group(1)}.{match.group(2)} (it is gone); slot w{match.group(1)} has "
                                   + ", ".join(p.metadata.name for p in slot))
        chosen = named[0]
    if previous:
        index = slot.index(chosen)
        if index > 0:
            return slot[index - 1].metadata.name, False
        return chosen.metadata.name, True  # the kubelet's earlier container of this pod, if any
    return chosen.metadata.name, False


def _one_instance(api, namespace: str, job: str, pods: list) -> list:
    """The worker pods of the one instance `job` names: where several have pods (two runs of the
    same name, or a retried step's earlier attempt), the one whose master publishes its status,
    else a refusal naming them all."""
    instances = {(p.metadata.labels or {}).get("app.kubernetes.io/instance") for p in pods}
    if len(instances) == 1:
        return pods
    found = status_map(api, namespace, job)
    if found is None:
        raise AmbiguousJob(job, namespace, sorted(f"{i} (worker pods, no running master)" for i in instances))
    return [p for p in pods if (p.metadata.labels or {}).get("app.kubernetes.io/instance") == instance_of(found)]


def submitted_master(api, namespace: str, job: str) -> str | None:
    """The master pod `elastic-step submit` made for `job`, running or ended: it stays, with its
    log, until `elastic-step delete`."""
    try:
        pods = api.list_namespaced_pod(namespace, label_selector=f"elastic-step/job={dns_label(job)},"
                                                                 "app.kubernetes.io/component=master").items
    except Exception:
        return None
    return max(pods, key=created_at).metadata.name if pods else None


def master_pod(api, namespace: str, job: str) -> tuple[str, str]:
    """The pod of a running job's master (its status ConfigMap's owner) and the master's
    container in it: `main` (Argo's and KFP's step container), else the pod's only one."""
    found = status_map(api, namespace, job)
    pod = master_pod_of(found) if found is not None else submitted_master(api, namespace, job)
    if pod is None:
        raise ElasticStepError(f"no running job {job!r} with a master pod in namespace {namespace}; an ended step's log "
                               "is its pipeline's (`argo logs`, the KFP UI, or `kubectl logs POD -c main`)")
    try:
        containers = [c.name for c in api.read_namespaced_pod(pod, namespace).spec.containers]
    except Exception as exc:
        raise ElasticStepError(f"cannot read the master's pod {pod} in {namespace}: {getattr(exc, 'reason', None) or exc}") from None
    return pod, "main" if "main" in containers else containers[0]


def pod_log(api, namespace: str, pod: str, previous: bool = False, tail: int | None = None, since_s: float | None = None,
            timestamps: bool = False, follow: bool = False, container: str = WORKER_CONTAINER):
    """A pod's log (pods/log, with the caller's credentials): its lines, streamed when following."""
    kwargs = {"container": container, "previous": previous, "timestamps": timestamps}
    if tail is not None:
        kwargs["tail_lines"] = tail
    if since_s is not None:
        kwargs["since_seconds"] = max(int(since_s), 1)
    try:
        if follow:
            stream = api.read_namespaced_pod_log(pod, namespace, follow=True, _preload_content=False, **kwargs)
            pending = b""
            for chunk in stream.stream():
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    yield line.decode("utf-8", errors="replace")
            if pending:
                yield pending.decode("utf-8", errors="replace")
            return
        text = api.read_namespaced_pod_log(pod, namespace, **kwargs)
    except Exception as exc:
        reason = getattr(exc, "reason", None) or exc
        raise ElasticStepError(f"cannot read the log of pod {pod} in {namespace}: {reason}"
                               + ("; it has no earlier container" if previous else "")) from None
    yield from text.splitlines()
