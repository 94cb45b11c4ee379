"""Server-side printing: the `meta.k8s.io/v1` Table kubectl asks for (`Accept: application/json;
as=Table;v=v1;g=meta.k8s.io`) when it prints `get` for a human, with the columns
kube-apiserver's printers give (pkg/printers/internalversion/printers.go): a pod's NAME, READY,
STATUS, RESTARTS, AGE and, at priority 1 (`-o wide`), IP, NODE, NOMINATED NODE, READINESS GATES;
a node's, a namespace's and an event's; every other kind NAME and CREATED AT, as the default
table convertor does.

Each row carries the object as `includeObject` asks: `Metadata` (the default) a
PartialObjectMetadata, `Object` the whole object, `None` nothing."""

from __future__ import annotations

import datetime


def wants_table(accept: str | None) -> bool:
    return bool(accept) and "as=Table" in accept and "g=meta.k8s.io" in accept


def _parse_time(text: str | None) -> datetime.datetime | None:
    if not text:
        return None
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)


def age(text: str | None) -> str:
    """duration.HumanDuration: `45s`, `3m12s`, `2h5m`, `4d`."""
    start = _parse_time(text)
    if start is None:
        return "<unknown>"
    seconds = max(0, int((datetime.datetime.now(datetime.timezone.utc) - start).total_seconds()))
    if seconds < 120:
        return f"{seconds}s"
    minutes = seconds // 60
    if minutes < 10:
        return f"{minutes}m{seconds % 60}s" if seconds % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = minutes // 60
    if hours < 48:
        return f"{hours}h{minutes % 60}m" if hours < 8 and minutes % 60 else f"{hours}h"
    return f"{hours // 24}d"


def pod_status_text(pod: dict) -> str:
    """printPod's STATUS: the pod's reason, else a container's waiting/terminated reason, else its phase."""
    status = pod.get("status") or {}
    reason = status.get("reason") or status.get("phase") or "Pending"
    for c in status.get("initContainerStatuses") or []:
        terminated, waiting = (c.get("state") or {}).get("terminated"), (c.get("state") or {}).get("waiting")
        if terminated and terminated.get("exitCode") != 0:
            return f"Init:{terminated.get('reason') or 'ExitCode:' + str(terminated.get('exitCode'))}"
        if waiting and waiting.get("reason") not in (None, "PodInitializing"):
            return f"Init:{waiting['reason']}"
    running = False
    for c in reversed(status.get("containerStatuses") or []):
        state = c.get("state") or {}
        if (state.get("waiting") or {}).get("reason"):
            reason = state["waiting"]["reason"]
        elif state.get("terminated"):
            terminated = state["terminated"]
            reason = terminated.get("reason") or (f"Signal:{terminated['signal']}" if terminated.get("signal")
                                                  else f"ExitCode:{terminated.get('exitCode')}")
        elif c.get("ready") and state.get("running"):
            running = True
    if reason == "Completed" and running:  # one container still runs: the pod does
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or [])
        reason = "Running" if ready else "NotReady"
    if pod["metadata"].get("deletionTimestamp"):
        return "Terminating"
    return reason


def _pod_row(pod: dict) -> list:
    status = pod.get("status") or {}
    containers = status.get("containerStatuses") or []
    ready = sum(1 for c in containers if c.get("ready"))
    restarts = sum(c.get("restartCount", 0) for c in containers)
    last = max(((c.get("lastState") or {}).get("terminated") or {}).get("finishedAt") or "" for c in containers) if containers else ""
    restart_text = f"{restarts} ({age(last)} ago)" if restarts and last else str(restarts)
    total = len((pod.get("spec") or {}).get("containers") or [])
    return [pod["metadata"]["name"], f"{ready}/{total}", pod_status_text(pod), restart_text, age(pod["metadata"].get("creationTimestamp")),
            status.get("podIP") or "<none>", (pod.get("spec") or {}).get("nodeName") or "<none>",
            status.get("nominatedNodeName") or "<none>", "<none>"]


def _node_row(node: dict) -> list:
    ready = next((c["status"] for c in (node.get("status") or {}).get("conditions") or [] if c["type"] == "Ready"), "Unknown")
    text = "Ready" if ready == "True" else "NotReady"
    if (node.get("spec") or {}).get("unschedulable"):
        text += ",SchedulingDisabled"
    info = (node.get("status") or {}).get("nodeInfo") or {}
    address = next((a["address"] for a in (node.get("status") or {}).get("addresses") or [] if a["type"] == "InternalIP"), "<none>")
    return [node["metadata"]["name"], text, "<none>", age(node["metadata"].get("creationTimestamp")), info.get("kubeletVersion", ""),
            address]


def _column(name: str, kind: str = "string", priority: int = 0, fmt: str = "") -> dict:
    return {"name": name, "type": kind, "format": fmt, "description": name, "priority": priority}


def _namespace_row(ns: dict) -> list:
    return [ns["metadata"]["name"], (ns.get("status") or {}).get("phase", "Active"), age(ns["metadata"].get("creationTimestamp"))]


def _event_row(event: dict) -> list:
    involved = event.get("involvedObject") or {}
    return [age(event.get("lastTimestamp")), event.get("type", ""), event.get("reason", ""),
            f"{involved.get('kind', '').lower()}/{involved.get('name', '')}", event.get("message", "")]


COLUMNS = {
    "pods": ([_column("Name", fmt="name"), _column("Ready"), _column("Status"), _column("Restarts"), _column("Age"),
              _column("IP", priority=1), _column("Node", priority=1), _column("Nominated Node", priority=1),
              _column("Readiness Gates", priority=1)], _pod_row),
    "nodes": ([_column("Name", fmt="name"), _column("Status"), _column("Roles"), _column("Age"), _column("Version"),
               _column("Internal-IP", priority=1)], _node_row),
    "namespaces": ([_column("Name", fmt="name"), _column("Status"), _column("Age")], _namespace_row),
    "events": ([_column("Last Seen"), _column("Type"), _column("Reason"), _column("Object"), _column("Message")], _event_row),
}


def _default_row(obj: dict) -> list:
    return [obj["metadata"]["name"], obj["metadata"].get("creationTimestamp")]


def table(plural: str, objects: list[dict], resource_version: str, include_object: str | None) -> dict:
    columns, row = COLUMNS.get(plural, ([_column("Name", fmt="name"), _column("Created At", "date")], _default_row))
    rows = []
    for obj in objects:
        entry = {"cells": row(obj)}
        if include_object == "Object":
            entry["object"] = obj
        elif include_object != "None":
            entry["object"] = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj["metadata"]}
        rows.append(entry)
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": resource_version},
            "columnDefinitions": columns, "rows": rows}
