"""Jobs on Kubernetes as `elastic-step list|get|top|stop|scale --backend kubernetes` show and
steer them: found by the labels every object of a job carries (app.kubernetes.io/managed-by=
elastic-step, elastic-step/job), read with the caller's own credentials (kubeconfig or
in-cluster), never the master's: the worker pods, and the status ConfigMap the master keeps
current and takes requests from (deploy/operator's Role grants exactly this). Their logs:
operate/pods.py."""

from __future__ import annotations

import datetime
import json
import time

from elastic_step.backends.kubernetes.manifests import SCALE_ANNOTATION, STATUS_KEY, STOP_ANNOTATION, dns_label
from elastic_step.errors import ElasticStepError
from elastic_step.operate.documents import checked_events, checked_status
from elastic_step.operate.folder import view_of

SELECTOR = "app.kubernetes.io/managed-by=elastic-step"
STATUS_SELECTOR = SELECTOR + ",app.kubernetes.io/component=status"
ENDED = ("succeeded", "failed", "stopped", "preempted")


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
    published = _published(api, namespace)
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
        status = published.get(instance)
        if status is not None:  # what the master says: the job's own state and progress
            epoch = status.get("epoch")
            rows[-1].update(state=status.get("state", state), target_workers=status.get("target_workers"),
                            epoch=epoch + 1 if epoch is not None else None, epochs=status.get("epochs"),
                            rows_done=status.get("rows_done"), rows_total=status.get("rows_total"),
                            samples_per_s=status.get("samples_per_s"))
    return rows


def _published(api, namespace: str) -> dict[str, dict]:
    """instance -> the status its master published; empty where the caller may not read them."""
    try:
        maps = api.list_namespaced_config_map(namespace, label_selector=STATUS_SELECTOR).items
    except Exception:
        return {}
    out = {}
    for m in maps:
        try:
            out[(m.metadata.labels or {}).get("app.kubernetes.io/instance")] = json.loads(m.data[STATUS_KEY])["status"]
        except (KeyError, TypeError, ValueError):
            continue
    return out


def status_map(api, namespace: str, job: str):
    """The status ConfigMap of job `job` (its name, one instance of it, or the name it was given,
    which several runs may share); None when the job has none (it ended, or never started).
    Refuses a name that several running instances answer to, naming them: picking one (the
    newest, as before) let `stop` stop someone else's run."""
    try:
        maps = api.list_namespaced_config_map(namespace, label_selector=STATUS_SELECTOR).items
    except Exception as exc:
        raise ElasticStepError(f"cannot read the jobs' status in namespace {namespace}: {getattr(exc, 'reason', None) or exc}; "
                               "check --namespace, and that you have deploy/operator's Role there (configmaps list, patch)") from None
    mine = [m for m in maps if _answers_to(m, job)]
    phases = {m.metadata.name: _owner_phase(api, namespace, m) for m in mine}
    bound = [m for m in mine if phases[m.metadata.name] is not None]
    # Best: the ConfigMap whose owner also owns the instance's worker pods (only a master makes
    # them); then one owned by a live pod (while its workers are being made or replaced); a
    # master that cannot own objects here (another namespace: owner references never cross one)
    # publishes without an owner, and that is taken only when nothing bound is there.
    workers = _worker_owners(api, namespace)
    proven = [m for m in bound if _owner(m).uid in workers.get(instance_of(m), set())]
    found = proven or bound or [m for m in mine if _named_as_made(m) and not _owner(m)]
    # A retried step leaves its earlier attempt's pod (Argo and KFP keep it): a master killed
    # before it could delete its status is no longer a candidate once its pod has ended.
    running = [m for m in found if phases[m.metadata.name] not in ("Succeeded", "Failed")]
    found = running or found
    if len({instance_of(m) for m in found}) > 1:
        raise AmbiguousJob(job, namespace, [_candidate(m, namespace) for m in sorted(found, key=created_at)])
    return max(found, key=created_at, default=None)


class AmbiguousJob(ElasticStepError):
    """A job name that several running jobs answer to: the caller names one of their instances."""

    def __init__(self, job: str, namespace: str, candidates: list[str]):
        self.candidates = candidates
        super().__init__(f"{len(candidates)} jobs in namespace {namespace} answer to {job!r}: " + "; ".join(candidates)
                         + "; name one by its instance (the first word of each)")


def _answers_to(config_map, job: str) -> bool:
    """`job` is the ConfigMap's job name, its instance, or the name its master was given."""
    labels = config_map.metadata.labels or {}
    if {job, dns_label(job)} & {labels.get("elastic-step/job"), labels.get("app.kubernetes.io/instance")}:
        return True
    try:
        return json.loads(config_map.data[STATUS_KEY])["info"]["job"] == job
    except (KeyError, TypeError, ValueError):
        return False


def _candidate(config_map, namespace: str) -> str:
    """One line for a person choosing among jobs of the same name."""
    try:
        document = json.loads(config_map.data[STATUS_KEY])
        state, started = document["status"].get("state", "?"), document["info"].get("started_at")
    except (KeyError, TypeError, ValueError, AttributeError):
        state, started = "?", None
    when = datetime.datetime.fromtimestamp(started, datetime.timezone.utc).isoformat(timespec="seconds") \
        if isinstance(started, (int, float)) else "?"
    return f"{instance_of(config_map)} ({state}, started {when}, master pod {master_pod_of(config_map) or '?'})"


def instance_of(config_map) -> str | None:
    return (config_map.metadata.labels or {}).get("app.kubernetes.io/instance")


def _named_as_made(config_map) -> bool:
    """A master names its status ConfigMap after its instance (manifests.JobNames.status_map)."""
    return config_map.metadata.name == f"{instance_of(config_map)}-status"


def _owner(config_map):
    return next((o for o in config_map.metadata.owner_references or [] if o.kind == "Pod"), None)


def _owner_phase(api, namespace: str, config_map) -> str | None:
    """The phase of the pod that owns `config_map`, when it is named after its instance and that
    pod exists with the UID its owner reference names; else None. Labels are anyone's to copy:
    a ConfigMap planted with a job's labels (newer, so once taken for the job's own) fails this,
    or is outranked by the one whose owner made the workers."""
    owner = _owner(config_map)
    if owner is None or not _named_as_made(config_map):
        return None
    try:
        pod = api.read_namespaced_pod(owner.name, namespace)
    except Exception:
        return None
    return ((pod.status.phase if pod.status else None) or "Pending") if pod.metadata.uid == owner.uid else None


def _worker_owners(api, namespace: str) -> dict[str, set[str]]:
    """instance -> the UIDs of the pods that own its worker pods (its master's)."""
    try:
        pods = api.list_namespaced_pod(namespace, label_selector=WORKER_SELECTOR).items
    except Exception:
        return {}
    owners: dict[str, set[str]] = {}
    for p in pods:
        owners.setdefault((p.metadata.labels or {}).get("app.kubernetes.io/instance"), set()).update(
            o.uid for o in p.metadata.owner_references or [] if o.kind == "Pod")
    return owners


def master_pod_of(config_map) -> str | None:
    owners = [o.name for o in config_map.metadata.owner_references or [] if o.kind == "Pod"]
    return owners[0] if owners else None


def published_document(config_map, namespace: str) -> dict:
    """What the master published: {info, status, events, events_next, history[, stop_refused][, ps_scales]}."""
    try:
        document = json.loads(config_map.data[STATUS_KEY])
        document["status"], document["info"]  # noqa: B018  (both must be there)
    except (KeyError, TypeError, ValueError) as exc:
        raise ElasticStepError(f"ConfigMap {config_map.metadata.name} in {namespace} holds no readable job status ({exc}); "
                               "it was changed by hand: its master rewrites it within seconds, try again") from None
    document["status"] = checked_status(document["status"], f"ConfigMap {namespace}/{config_map.metadata.name}")
    document["events"] = checked_events(document.get("events", []))
    return document


def published_job(config_map, namespace: str) -> dict:
    """The job as its master last published it, in the shape `folder.view_of` shows."""
    document = published_document(config_map, namespace)
    status, info = document["status"], document["info"]
    info = {**info, "namespace": namespace, "master_pod": master_pod_of(config_map), "status_map": config_map.metadata.name}
    return {"live": status.get("state") not in ENDED, "remote": True, "status": status, "events": document.get("events", []),
            "info": info, "result": None, "stop_refused": document.get("stop_refused", "")}


def where_of(info: dict) -> str:
    pod = info.get("master_pod")
    return f"pod {info['namespace']}/{pod}" if pod else f"ConfigMap {info['namespace']}/{info['status_map']}"


def kubernetes_view(job: str, namespace: str | None, with_events: bool = False, mlflow_uri: str | None = None, api=None) -> dict:
    """`get`/`top` of a job on Kubernetes: its published status while it runs; once it has
    ended (its master deleted the status with the rest of the job), its MLflow run."""
    api = api or core_api()
    namespace = namespace or current_namespace()
    found = status_map(api, namespace, job)
    if found is not None:
        loaded = published_job(found, namespace)
        return view_of(loaded, where_of(loaded["info"]), with_events)
    if mlflow_uri:
        from elastic_step.operate.record import job_from_mlflow

        recorded = job_from_mlflow(job, mlflow_uri)
        if recorded is not None:
            return view_of(recorded, "MLflow (the job has ended)", with_events)
    raise ElasticStepError(f"no running job {job!r} in namespace {namespace}" + ("" if mlflow_uri else
                           "; for one that ended, pass --mlflow-uri (or set MLFLOW_TRACKING_URI) to read its MLflow run")
                           + "; see `elastic-step list --backend kubernetes`")


def stop_kubernetes(job: str, namespace: str | None, timeout_s: float, wait: bool = True, api=None) -> str:
    """Ask job `job`'s master to stop (an annotation on its status ConfigMap, which it reads
    within seconds), then wait for its pod to end; what happened, for people."""
    api = api or core_api()
    namespace = namespace or current_namespace()
    found = status_map(api, namespace, job)
    if found is None:
        raise ElasticStepError(f"no running job {job!r} in namespace {namespace}; there is nothing to stop "
                               "(`elastic-step get --backend kubernetes JOB --mlflow-uri URI` shows how one ended)")
    loaded = published_job(found, namespace)
    if not loaded["live"]:
        raise ElasticStepError(f"job {job} has ended ({loaded['status'].get('state')}); there is nothing to stop")
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    try:
        api.patch_namespaced_config_map(found.metadata.name, namespace, {"metadata": {"annotations": {STOP_ANNOTATION: stamp}}})
    except Exception as exc:
        raise ElasticStepError(f"cannot ask job {job} to stop: {getattr(exc, 'reason', None) or exc} on ConfigMap "
                               f"{found.metadata.name}; you need deploy/operator's Role in {namespace} (configmaps patch)") from None
    if not wait:
        return f"asked job {job} to stop; its master takes the request within seconds"
    pod = loaded["info"].get("master_pod")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        current = status_map(api, namespace, instance_of(found))  # this instance: the name may be taken again meanwhile
        if current is not None and current.metadata.name == found.metadata.name:
            published = published_job(current, namespace)
            if published["stop_refused"]:
                raise ElasticStepError(f"job {job} cannot stop: {published['stop_refused']}")
        elif pod is None:
            return f"job {job} ended (its status is gone); see its MLflow run"
        phase = _phase(api, namespace, pod) if pod else None
        if phase == "Succeeded":
            return (f"job {job} stopped at a checkpoint (its master pod {pod} ended Succeeded); `elastic-step train` "
                    "with the same options and --resume continues it")
        if phase == "gone":
            return f"job {job} ended; its master pod {pod} was deleted meanwhile, so how it ended is in its MLflow run"
        if phase == "Failed":
            raise ElasticStepError(f"job {job} ended Failed, not stopped; see `elastic-step logs --backend kubernetes` "
                                   f"and `kubectl logs -n {namespace} {pod}`")
        time.sleep(1.0)
    raise ElasticStepError(f"job {job} did not stop within {timeout_s:.0f}s; see `elastic-step get --backend kubernetes {job} -e`")


def scale_kubernetes(job: str, namespace: str, workers: int, api) -> str:
    """Ask job `job`'s master for `workers` workers (an annotation on its status ConfigMap, which it
    reads within seconds), within the range it published."""
    found = status_map(api, namespace, job)
    if found is None:
        raise ElasticStepError(f"no running job {job!r} in namespace {namespace}; there is nothing to scale")
    status = published_job(found, namespace)["status"]
    low, high = status.get("workers_range") or (1, workers)
    if status.get("state") in ENDED or not low <= workers <= high:
        raise ElasticStepError(f"job {job} cannot run {workers} workers: " + (f"it has ended ({status['state']})"
                               if status.get("state") in ENDED else f"--workers {workers} is outside its range {low}:{high}"))
    try:
        api.patch_namespaced_config_map(found.metadata.name, namespace, {"metadata": {"annotations": {SCALE_ANNOTATION: str(workers)}}})
    except Exception as exc:
        raise ElasticStepError(f"cannot ask job {job} to scale: {getattr(exc, 'reason', None) or exc} on ConfigMap "
                               f"{found.metadata.name}; you need deploy/operator's Role in {namespace} (configmaps patch)") from None
    return f"asked job {job} for {workers} workers; its master takes the request within seconds"


def _phase(api, namespace: str, pod: str) -> str | None:
    """The pod's phase; "gone" once deleted; None while the API does not answer (asked again)."""
    try:
        return api.read_namespaced_pod(pod, namespace).status.phase
    except Exception as exc:
        return "gone" if getattr(exc, "status", None) == 404 else None


WORKER_SELECTOR = SELECTOR + ",app.kubernetes.io/component=worker"


def created_at(pod):
    return pod.metadata.creation_timestamp or datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)
