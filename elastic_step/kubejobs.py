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
