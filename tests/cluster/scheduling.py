"""The scheduler stand-in: binds each pending pod to the one node when it fits, as kube-scheduler's
default plugins judge it, talking to the API only through the real client with its own token.

The node is a Node object (`node_object`) the cluster registers for its kubelet, with
`status.allocatable` cpu, memory and pods; a test removes or returns capacity by replacing the
node's status (`Cluster.set_allocatable`), cordons it with `spec.unschedulable`.

As kube-scheduler does (pkg/scheduler/framework/plugins):
- NodeResourcesFit: a pod's request is, per resource, the larger of its containers' sum and its
  largest init container (a container's request defaults to its limit); the node's used share is
  the requests of the pods bound to it that have not finished (Succeeded/Failed);
- NodeUnschedulable, NodeName and the pod's `nodeSelector` against the node's labels;
- a pod that does not fit stays Pending with the condition `PodScheduled=False`, reason
  `Unschedulable` and the scheduler's message (`0/1 nodes are available: 1 Insufficient cpu.`),
  also a `FailedScheduling` Warning event (what `kubectl describe pod` lists),
  and is tried again whenever a pod or the node changes (a pod ends, capacity returns);
- higher `spec.priority` first, then the older pod.
Not modelled: preemption (the message says no victims were found, or, for a pod that could not fit
the node even empty, that preemption is not helpful, as kube-scheduler says it), taints and tolerations,
affinity, topology spread, extended resources other than `nvidia.com/gpu`.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from decimal import Decimal

from kubernetes import client as k8s
from kubernetes import watch
from kubernetes.utils.quantity import parse_quantity

from .labels import selector_matches
from .objects import now_text

log = logging.getLogger("cluster.scheduler")

SCHEDULER_USER = "system:kube-scheduler"
SCHEDULER_RULES = [  # the share of system:kube-scheduler's ClusterRole this scheduler calls
    {"apiGroups": [""], "resources": ["pods", "nodes"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [""], "resources": ["pods/binding"], "verbs": ["create"]},
    {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["update", "patch"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
]
RESOURCES = ("cpu", "memory", "nvidia.com/gpu")
DEFAULT_ALLOCATABLE = {"cpu": "64", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": "0"}


def node_object(name: str, ip: str, allocatable: dict[str, str] | None = None) -> dict:
    """The Node a kubelet registers: its address, capacity = allocatable, Ready."""
    allocatable = {**DEFAULT_ALLOCATABLE, **(allocatable or {})}
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"}},
            "spec": {},
            "status": {"capacity": dict(allocatable), "allocatable": dict(allocatable),
                       "addresses": [{"type": "InternalIP", "address": ip}, {"type": "Hostname", "address": name}],
                       "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                       "message": "kubelet is posting ready status", "lastHeartbeatTime": now_text(),
                                       "lastTransitionTime": now_text()}],
                       "nodeInfo": {"kubeletVersion": "v1.32.0", "operatingSystem": "linux", "architecture": "amd64",
                                    "containerRuntimeVersion": "process://1", "osImage": "stand-in", "kernelVersion": "",
                                    "kubeProxyVersion": "", "machineID": "", "systemUUID": "", "bootID": ""}}}


def pod_requests(pod: dict) -> dict[str, Decimal]:
    """What a pod asks of a node (resourcehelper.PodRequests, without overhead)."""
    def of(container: dict) -> dict[str, Decimal]:
        resources = container.get("resources") or {}
        asked = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        return {r: Decimal(parse_quantity(asked[r])) for r in RESOURCES if r in asked}

    spec = pod.get("spec") or {}
    total = {r: Decimal(0) for r in RESOURCES}
    for container in spec.get("containers") or []:
        for r, v in of(container).items():
            total[r] += v
    for container in spec.get("initContainers") or []:
        for r, v in of(container).items():
            total[r] = max(total[r], v)
    return total


def unfit_reasons(pod: dict, node: dict, bound: list[dict]) -> list[str]:
    """Why `pod` cannot go to `node` with `bound` on it (empty: it fits), in the scheduler's words."""
    spec = pod.get("spec") or {}
    if (node.get("spec") or {}).get("unschedulable"):
        return ["node(s) were unschedulable"]
    if not selector_matches(node["metadata"].get("labels"), ",".join(f"{k}={v}" for k, v in (spec.get("nodeSelector") or {}).items())):
        return ["node(s) didn't match Pod's node affinity/selector"]
    allocatable = node.get("status", {}).get("allocatable") or {}
    live = [p for p in bound if p.get("status", {}).get("phase") not in ("Succeeded", "Failed")]
    reasons = []
    if len(live) + 1 > int(allocatable.get("pods", "110")):
        reasons.append("Too many pods")
    asked, used = pod_requests(pod), {r: Decimal(0) for r in RESOURCES}
    for other in live:
        for r, v in pod_requests(other).items():
            used[r] += v
    for r in RESOURCES:
        if asked[r] > 0 and used[r] + asked[r] > Decimal(parse_quantity(allocatable.get(r, "0"))):
            reasons.append(f"Insufficient {r}")
    return reasons


def unschedulable_message(reasons: list[str], never_fits: bool = False) -> str:
    """kube-scheduler's words; `never_fits`: no freed capacity could help (the pod asks more than
    the node's allocatable, or the node does not match it), which its preemption says so."""
    preemption = "1 Preemption is not helpful for scheduling." if never_fits else "1 No preemption victims found for incoming pod."
    return f"0/1 nodes are available: {', '.join('1 ' + r for r in reasons)}. preemption: 0/1 nodes are available: {preemption}"


def never_fits(pod: dict, node: dict) -> bool:
    """Whether `pod` could not go to `node` even with nothing else on it."""
    return bool(unfit_reasons(pod, node, [])) and not (node.get("spec") or {}).get("unschedulable")


class Scheduler:
    """Binds pending pods to `node_name`; runs until close()."""

    def __init__(self, api: k8s.CoreV1Api, node_name: str):
        self.api = api
        self.node_name = node_name
        self.closed = False
        self._wake = threading.Event()
        self._watches: list[watch.Watch] = []
        self._threads = [threading.Thread(target=self._watch_loop, args=(api.list_pod_for_all_namespaces,), daemon=True,
                                          name="scheduler-pods"),
                         threading.Thread(target=self._watch_loop, args=(api.list_node,), daemon=True, name="scheduler-nodes"),
                         threading.Thread(target=self._schedule_loop, daemon=True, name="scheduler")]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        self.closed = True
        for w in list(self._watches):
            w.stop()
        self._wake.set()

    def _watch_loop(self, lister) -> None:
        """Any change of a pod or the node is a reason to try the pending pods again."""
        while not self.closed:
            w = watch.Watch(return_type="object")  # the event itself is all it needs: no model objects built
            self._watches.append(w)
            try:
                for _ in w.stream(lister, timeout_seconds=60):
                    self._wake.set()
                    if self.closed:
                        return
            except Exception as exc:  # a dropped watch or a 410: start over from the current state
                if not self.closed:
                    log.info("scheduler watch interrupted: %s", exc)
                    self._wake.wait(0.2)
            finally:
                self._watches.remove(w)

    def _schedule_loop(self) -> None:
        while not self.closed:
            self._wake.wait(2.0)
            self._wake.clear()
            if self.closed:
                return
            try:
                self.schedule_pending()
            except Exception as exc:  # the API refused: try again at the next change
                log.warning("scheduler: %s", exc)

    def schedule_pending(self) -> None:
        node = json.loads(self.api.read_node(self.node_name, _preload_content=False).data)
        pods = json.loads(self.api.list_pod_for_all_namespaces(_preload_content=False).data)["items"]
        bound = [p for p in pods if p["spec"].get("nodeName") == self.node_name]
        pending = [p for p in pods if not p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")
                   and p["spec"].get("schedulerName", "default-scheduler") == "default-scheduler"]
        pending.sort(key=lambda p: (-(p["spec"].get("priority") or 0), p["metadata"]["creationTimestamp"], p["metadata"]["name"]))
        for pod in pending:
            reasons = unfit_reasons(pod, node, bound)
            if reasons:
                self._mark_unschedulable(pod, unschedulable_message(reasons, never_fits(pod, node)))
                continue
            if self._bind(pod):
                pod["spec"]["nodeName"] = self.node_name
                bound.append(pod)

    def _bind(self, pod: dict) -> bool:
        meta = pod["metadata"]
        body = k8s.V1Binding(metadata=k8s.V1ObjectMeta(name=meta["name"]),
                             target=k8s.V1ObjectReference(kind="Node", name=self.node_name, api_version="v1"))
        try:
            self.api.create_namespaced_pod_binding(meta["name"], meta["namespace"], body, _preload_content=False)
            return True
        except k8s.ApiException as exc:
            if exc.status not in (404, 409):
                log.warning("binding %s failed: %s %s", meta["name"], exc.status, exc.reason)
            return False

    def _mark_unschedulable(self, pod: dict, message: str) -> None:
        status = pod.setdefault("status", {})
        conditions = status.get("conditions") or []
        if any(c["type"] == "PodScheduled" and c.get("message") == message for c in conditions):
            return  # already said: no write, no event
        status["conditions"] = [c for c in conditions if c["type"] != "PodScheduled"] + [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message,
             "lastTransitionTime": now_text()}]
        try:
            self.api.replace_namespaced_pod_status(pod["metadata"]["name"], pod["metadata"]["namespace"], pod, _preload_content=False)
            self.api.create_namespaced_event(pod["metadata"]["namespace"], failed_scheduling_event(pod, message), _preload_content=False)
        except k8s.ApiException as exc:
            if exc.status not in (404, 409):
                raise


def failed_scheduling_event(pod: dict, message: str) -> dict:
    """The Warning `kubectl describe pod` shows under Events for a pod that does not fit."""
    meta, now = pod["metadata"], now_text()
    return {"apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": meta["namespace"]},
            "involvedObject": {"kind": "Pod", "apiVersion": "v1", "namespace": meta["namespace"], "name": meta["name"],
                               "uid": meta["uid"], "resourceVersion": meta.get("resourceVersion", "")},
            "type": "Warning", "reason": "FailedScheduling", "message": message, "count": 1,
            "firstTimestamp": now, "lastTimestamp": now, "source": {"component": "default-scheduler"},
            "reportingComponent": "default-scheduler", "reportingInstance": "default-scheduler"}
