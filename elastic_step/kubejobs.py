"""Jobs on Kubernetes as `elastic-step list --backend kubernetes` shows them: found by the labels
every worker pod carries (app.kubernetes.io/managed-by=elastic-step, elastic-step/job), with the
caller's own credentials (kubeconfig or in-cluster), never the master's."""

from __future__ import annotations

import datetime

from elastic_step.errors import ElasticStepError

SELECTOR = "app.kubernetes.io/managed-by=elastic-step"


def core_api():
    from kubernetes import client, config

    try:
        config.load_kube_config()
    except Exception:
        try:
            config.load_incluster_config()
        except Exception as exc:
            raise ElasticStepError(f"no Kubernetes credentials ({exc}); set KUBECONFIG or run inside the cluster") from None
    return client.CoreV1Api()


def current_namespace() -> str:
    try:
        from kubernetes import config

        _, context = config.list_kube_config_contexts()
        return context["context"].get("namespace", "default")
    except Exception:
        return "default"


def list_kubernetes(namespace: str | None, api=None) -> list[dict]:
    """One row per job instance in `namespace`: its workers' pods by phase, the oldest pod's age."""
    api = api or core_api()
    namespace = namespace or current_namespace()
    try:
        pods = api.list_namespaced_pod(namespace, label_selector=SELECTOR).items
    except Exception as exc:
        raise ElasticStepError(f"cannot list pods in namespace {namespace}: {getattr(exc, 'reason', exc)}; "
                               "check --namespace and that you may list pods there") from None
    jobs: dict[str, list] = {}
    for pod in pods:
        labels = pod.metadata.labels or {}
        jobs.setdefault(labels.get("app.kubernetes.io/instance", "?"), []).append(pod)
    now = datetime.datetime.now(datetime.timezone.utc)
    rows = []
    for instance, members in sorted(jobs.items()):
        phases = [(p.status.phase if p.status else None) or "Pending" for p in members]
        created = [p.metadata.creation_timestamp for p in members if p.metadata.creation_timestamp]
        running = phases.count("Running")
        state = "running" if running else "pending" if "Pending" in phases else "ended"
        rows.append({
            "job": (members[0].metadata.labels or {}).get("elastic-step/job", instance), "instance": instance,
            "namespace": namespace, "state": state, "workers_live": running, "target_workers": len(members),
            "pods": {p.metadata.name: ph for p, ph in zip(members, phases)},
            "duration_s": (now - min(created)).total_seconds() if created else None,
        })
    return rows


WORKER_SELECTOR = SELECTOR + ",app.kubernetes.io/component=worker"
WORKER_CONTAINER = "worker"


def _created(pod):
    return pod.metadata.creation_timestamp or datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)


def worker_pod(api, namespace: str, job: str, worker: str | None, previous: bool) -> tuple[str, bool]:
    """The pod of a job's worker (`w1.2`, or `w1`: the slot's newest attempt), and whether to
    read its previous container. `previous`: the slot's earlier attempt's pod where it is still
    there, else the previous container of the same pod."""
    import re

    pods = [p for p in api.list_namespaced_pod(namespace, label_selector=WORKER_SELECTOR).items
            if job in ((p.metadata.labels or {}).get("elastic-step/job"), (p.metadata.labels or {}).get("app.kubernetes.io/instance"))]
    if not pods:
        raise ElasticStepError(f"no worker pods of job {job!r} in namespace {namespace}; see `elastic-step list --backend kubernetes`")
    match = re.match(r"^w?(\d+)(?:\.(\d+))?$", worker or "w0")
    if not match:
        raise ElasticStepError(f"--worker {worker!r} names no worker; use an id (w1.2) or a slot (w1)")
    slot = [p for p in pods if (p.metadata.labels or {}).get("elastic-step/replica-index") == match.group(1)]
    slot.sort(key=_created)
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


def pod_log(api, namespace: str, pod: str, previous: bool = False, tail: int | None = None, since_s: float | None = None,
            timestamps: bool = False, follow: bool = False):
    """A pod's log (pods/log, with the caller's credentials): its lines, streamed when following."""
    kwargs = {"container": WORKER_CONTAINER, "previous": previous, "timestamps": timestamps}
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
