"""Deployments, ReplicaSets and Services for the cluster stand-in: the controllers kube-controller-
manager and kube-proxy run, and the kubelet's readiness prober, each talking to the API server
only through the real client with a token of its own, so that what they create (pods) passes RBAC
and admission (PodSecurity, quotas) as it would in a cluster.

Read from kubernetes (pkg/controller/deployment: sync.go, rolling.go; pkg/controller/replicaset;
pkg/kubelet/prober; pkg/proxy), never copied:
- a Deployment owns one ReplicaSet per pod template, named `DEPLOYMENT-HASH` with the template's
  hash as its pods' `pod-template-hash` label; RollingUpdate with maxSurge 25% (rounded up) and
  maxUnavailable 25% (rounded down): the new ReplicaSet grows while the total stays within
  replicas + maxSurge, old ones shrink while the Ready pods stay at least replicas -
  maxUnavailable (old pods that are not Ready go first); a template seen before reuses its
  ReplicaSet (a rollback); `status` with observedGeneration, replicas, updatedReplicas,
  readyReplicas, availableReplicas and the Available condition;
- a ReplicaSet keeps `replicas` active pods (not finished, not being deleted) owned by it: it
  creates `RS-xxxxx` pods from its template and deletes the extra ones, not Ready ones first;
- the prober GETs each container's `readinessProbe.httpGet` every `periodSeconds` (first after
  `initialDelaySeconds`) within `timeoutSeconds`; `successThreshold` successes make the container
  Ready, `failureThreshold` failures not Ready; a restarted container (a new container ID) starts
  not Ready. It writes the pod's `Ready` condition through pods/status; the controllers and the
  Services count a pod Ready by the prober's own verdict, because the kubelet stand-in (which runs
  no probes) writes `Ready` from the phase whenever it writes a status;
- a Service's endpoints are the Ready, not terminating pods its selector matches, at its
  `targetPort` (a number or a container port's name); kube-proxy is played by one listener per
  Service port on the node's 127.0.0.1 (`service_url`) that sends each connection to the next
  endpoint in turn (kube-proxy's iptables mode picks at random; in turn keeps a test's shares exact).

Pods are reached as the node reaches them: their podIP on the node's network, or through the pod
network's port-forward (network.py) when each pod has an address of its own.
Not modelled: Recreate, minReadySeconds, progressDeadlineSeconds, paused rollouts,
revisionHistoryLimit (old ReplicaSets stay at 0), scale subresources, Endpoints/EndpointSlice
objects, ClusterIPs and DNS, liveness and startup probes, exec and tcpSocket probes."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import secrets
import socket
import threading
import time

import httpx
from kubernetes import client as k8s

from .labels import selector_matches
from .netrelay import pipe
from .objects import now_text

log = logging.getLogger("cluster.apps")

CONTROLLER_USER = "system:kube-controller-manager"
CONTROLLER_RULES = [  # the share of the deployment and replicaset controllers' rights they use
    {"apiGroups": ["apps"], "resources": ["deployments", "replicasets"], "verbs": ["get", "list", "watch", "create", "update", "delete"]},
    {"apiGroups": ["apps"], "resources": ["deployments/status", "replicasets/status"], "verbs": ["update"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "create", "delete"]},
    {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
]
HASH_LABEL = "pod-template-hash"


class Api:
    """JSON dicts over the real client: what the controllers read and write."""

    def __init__(self, api_client: k8s.ApiClient):
        self.client = api_client

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        response = self.client.call_api(path, method, body=body, auth_settings=["BearerToken"], _preload_content=False,
                                        header_params={"Content-Type": "application/json", "Accept": "application/json"})
        return json.loads(response[0].data or b"{}")

    def list(self, path: str) -> list[dict]:
        return self.call("GET", path)["items"]


def owned_by(obj: dict, owner: dict) -> bool:
    return any(r.get("uid") == owner["metadata"]["uid"] and r.get("controller")
               for r in obj["metadata"].get("ownerReferences") or [])


def owner_reference(owner: dict) -> dict:
    return {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": owner["metadata"]["name"],
            "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}


def template_hash(template: dict) -> str:
    """A short stable hash of a pod template (Kubernetes: fnv32a of the template, as a safe string)."""
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def active(pod: dict) -> bool:
    return not pod["metadata"].get("deletionTimestamp") and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


def container_ids(pod: dict) -> tuple:
    return tuple(s.get("containerID", "") for s in (pod.get("status") or {}).get("containerStatuses") or [])


class Prober:
    """The kubelet's readiness prober for httpGet probes (others: Ready once running)."""

    def __init__(self, api: Api, reach):
        self.api, self.reach = api, reach
        self.state: dict[str, dict] = {}  # pod uid -> {ids, ready, successes, failures, next_at}
        self.lock = threading.Lock()

    def ready(self, pod: dict) -> bool:
        if not active(pod) or (pod.get("status") or {}).get("phase") != "Running":
            return False
        with self.lock:
            state = self.state.get(pod["metadata"]["uid"])
        return bool(state and state["ids"] == container_ids(pod) and state["ready"])

    def probe_all(self, pods: list[dict]) -> None:
        for pod in pods:
            if active(pod) and (pod.get("status") or {}).get("phase") == "Running":
                self._probe(pod)
        with self.lock:
            live = {p["metadata"]["uid"] for p in pods}
            for uid in [u for u in self.state if u not in live]:
                del self.state[uid]

    def _probe(self, pod: dict) -> None:
        uid, ids = pod["metadata"]["uid"], container_ids(pod)
        probe = next((c.get("readinessProbe") for c in pod["spec"]["containers"] if c.get("readinessProbe")), None)
        with self.lock:
            state = self.state.get(uid)
            if state is None or state["ids"] != ids:  # a new container starts not Ready
                delay = (probe or {}).get("initialDelaySeconds", 0)
                state = self.state[uid] = {"ids": ids, "ready": False, "successes": 0, "failures": 0,
                                           "next_at": time.monotonic() + delay}
            if time.monotonic() < state["next_at"]:
                return
            state["next_at"] = time.monotonic() + (probe or {}).get("periodSeconds", 10)
        ok = self._get(pod, probe) if probe else all(
            "running" in (s.get("state") or {}) for s in pod["status"].get("containerStatuses") or [])
        with self.lock:
            state["successes"], state["failures"] = (state["successes"] + 1, 0) if ok else (0, state["failures"] + 1)
            if ok and state["successes"] >= (probe or {}).get("successThreshold", 1):
                state["ready"] = True
            elif not ok and state["failures"] >= (probe or {}).get("failureThreshold", 3):
                state["ready"] = False
            verdict = state["ready"]
        written = next((c["status"] for c in pod["status"].get("conditions") or [] if c["type"] == "Ready"), "")
        if written != ("True" if verdict else "False"):  # the kubelet stand-in may have written it from the phase
            self._write_condition(pod, verdict)

    def _get(self, pod: dict, probe: dict) -> bool:
        http = probe.get("httpGet")
        if not http:
            return True  # exec and tcpSocket probes: not modelled, Ready once running
        port = resolve_port(pod, http["port"])
        try:
            url = f"http://{self.reach(pod, port)}{http.get('path', '/')}"
            return 200 <= httpx.get(url, timeout=probe.get("timeoutSeconds", 1)).status_code < 400
        except (httpx.HTTPError, OSError, RuntimeError):
            return False

    def _write_condition(self, pod: dict, ready: bool) -> None:
        meta = pod["metadata"]
        try:
            current = self.api.call("GET", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}")
            conditions = [c for c in current["status"].get("conditions", []) if c["type"] not in ("Ready", "ContainersReady")]
            status = "True" if ready else "False"
            conditions += [{"type": t, "status": status, "lastTransitionTime": now_text()} for t in ("Ready", "ContainersReady")]
            for s in current["status"].get("containerStatuses") or []:
                s["ready"] = ready
            current["status"]["conditions"] = conditions
            self.api.call("PUT", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status", current)
        except k8s.ApiException as exc:  # gone, or the kubelet wrote first: the next round writes again
            log.debug("prober: pod %s: %s", meta["name"], exc.status)


def resolve_port(pod: dict, port) -> int:
    """A port number, or a container port's name in the pod."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for c in pod["spec"]["containers"]:
        for p in c.get("ports") or []:
            if p.get("name") == port:
                return int(p["containerPort"])
    raise RuntimeError(f"pod {pod['metadata']['name']} has no port named {port}")


class Apps:
    """The controllers, the prober and the Services' proxies; `start()` them, `close()` at the end."""

    def __init__(self, api_client: k8s.ApiClient, prober_client: k8s.ApiClient, network=None, period: float = 0.3):
        self.api = Api(api_client)
        self.network = network
        self.period = period
        self.prober = Prober(Api(prober_client), self.reach)
        self.proxies: dict[tuple[str, str, int], "ServiceProxy"] = {}
        self.pods: list[dict] = []  # the newest list, for the proxies
        self.closed = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="apps-controllers")

    def start(self) -> "Apps":
        self._thread.start()
        return self

    def close(self) -> None:
        self.closed = True
        self._thread.join(timeout=10)
        for proxy in self.proxies.values():
            proxy.close()

    def reach(self, pod: dict, port: int) -> str:
        """host:port at which the node reaches `port` of `pod`."""
        ip = pod["status"]["podIP"]
        if self.network is None:
            return f"{ip}:{port}"
        return f"127.0.0.1:{self.network.forward(pod['metadata']['uid'], ip, port)}"

    def service_url(self, namespace: str, name: str, port: int | None = None, timeout: float = 30.0) -> str:
        """http://127.0.0.1:P: the Service's port (its first by default) as kube-proxy serves it here."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [p for (ns, n, sp), p in self.proxies.items() if (ns, n) == (namespace, name) and port in (None, sp)]
            if found:
                return f"http://127.0.0.1:{found[0].port}"
            time.sleep(0.1)
        raise AssertionError(f"Service {namespace}/{name} has no proxy after {timeout}s")

    def ready_pods(self, namespace: str, selector: dict) -> list[dict]:
        return [p for p in self.pods if p["metadata"]["namespace"] == namespace
                and selector_matches(p["metadata"].get("labels"), ",".join(f"{k}={v}" for k, v in selector.items()))
                and self.prober.ready(p)]

    # -- the loop ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self.closed:
            try:
                self._round()
            except Exception as exc:  # a conflict or a dropped connection: the next round tries again
                if not self.closed:
                    log.info("apps controllers: %s", exc)
            time.sleep(self.period)

    def _round(self) -> None:
        self.pods = self.api.list("/api/v1/pods")
        self.prober.probe_all(self.pods)
        replica_sets = self.api.list("/apis/apps/v1/replicasets")
        for deployment in self.api.list("/apis/apps/v1/deployments"):
            self._sync_deployment(deployment, [rs for rs in replica_sets if owned_by(rs, deployment)])
        for rs in self.api.list("/apis/apps/v1/replicasets"):
            self._sync_replica_set(rs)
        self._sync_services(self.api.list("/api/v1/services"))

    # -- the deployment controller ----------------------------------------------------------------
    def _sync_deployment(self, d: dict, owned: list[dict]) -> None:
        spec, name, ns = d["spec"], d["metadata"]["name"], d["metadata"]["namespace"]
        if d["metadata"].get("deletionTimestamp"):
            return
        digest = template_hash(spec["template"])
        new = next((rs for rs in owned if rs["metadata"].get("labels", {}).get(HASH_LABEL) == digest), None)
        if new is None:
            new = self._create_replica_set(d, digest)
            owned.append(new)
        olds = sorted((rs for rs in owned if rs is not new), key=lambda rs: rs["metadata"]["creationTimestamp"])
        want = spec.get("replicas", 1)
        surge, unavailable = rolling_limits(want, (spec.get("strategy") or {}).get("rollingUpdate") or {})
        pods = {rs["metadata"]["uid"]: [p for p in self.pods if owned_by(p, rs) and active(p)] for rs in owned}
        ready = {uid: sum(self.prober.ready(p) for p in ps) for uid, ps in pods.items()}
        total = sum(rs["spec"].get("replicas", 0) for rs in owned)
        new_count = new["spec"].get("replicas", 0)
        target = min(want, new_count + max(0, want + surge - total)) if new_count < want else want
        self._scale(new, target)
        # old ReplicaSets: not-Ready pods may go at once; Ready ones while enough stay Ready
        all_pods = sum(len(ps) for ps in pods.values())
        new_unready = target - ready[new["metadata"]["uid"]]
        room = max(0, all_pods - (want - unavailable) - new_unready)
        for rs in olds:
            current = rs["spec"].get("replicas", 0)
            unready = current - ready[rs["metadata"]["uid"]]
            drop = min(current, max(0, unready) + room)
            room -= max(0, drop - max(0, unready))
            self._scale(rs, current - drop)
        self._deployment_status(d, new, owned, pods, ready)

    def _create_replica_set(self, d: dict, digest: str) -> dict:
        meta = d["metadata"]
        template = json.loads(json.dumps(d["spec"]["template"]))
        template.setdefault("metadata", {}).setdefault("labels", {})[HASH_LABEL] = digest
        selector = json.loads(json.dumps(d["spec"]["selector"]))
        selector.setdefault("matchLabels", {})[HASH_LABEL] = digest
        body = {"apiVersion": "apps/v1", "kind": "ReplicaSet",
                "metadata": {"name": f"{meta['name']}-{digest}", "namespace": meta["namespace"],
                             "labels": template["metadata"]["labels"], "ownerReferences": [owner_reference(d)]},
                "spec": {"replicas": 0, "selector": selector, "template": template}}
        return self.api.call("POST", f"/apis/apps/v1/namespaces/{meta['namespace']}/replicasets", body)

    def _scale(self, rs: dict, replicas: int) -> None:
        if rs["spec"].get("replicas", 0) != replicas:
            rs["spec"]["replicas"] = replicas
            meta = rs["metadata"]
            updated = self.api.call("PUT", f"/apis/apps/v1/namespaces/{meta['namespace']}/replicasets/{meta['name']}", rs)
            rs["metadata"] = updated["metadata"]

    def _deployment_status(self, d: dict, new: dict, owned: list[dict], pods: dict, ready: dict) -> None:
        want = d["spec"].get("replicas", 1)
        total_ready = sum(ready.values())
        new_pods = len(pods[new["metadata"]["uid"]])
        status = {"observedGeneration": d["metadata"].get("generation", 1),
                  "replicas": sum(len(ps) for ps in pods.values()), "updatedReplicas": new_pods,
                  "readyReplicas": total_ready, "availableReplicas": total_ready,
                  "unavailableReplicas": max(0, want - total_ready)}
        available = total_ready >= want - rolling_limits(want, (d["spec"].get("strategy") or {}).get("rollingUpdate") or {})[1]
        status["conditions"] = [{"type": "Available", "status": "True" if available else "False",
                                 "reason": "MinimumReplicasAvailable" if available else "MinimumReplicasUnavailable",
                                 "message": f"Deployment {'has' if available else 'does not have'} minimum availability."}]
        status = {k: v for k, v in status.items() if v or k in ("observedGeneration", "conditions")}  # zero counts are omitted
        if (d.get("status") or {}) != status:
            d["status"] = status
            meta = d["metadata"]
            self.api.call("PUT", f"/apis/apps/v1/namespaces/{meta['namespace']}/deployments/{meta['name']}/status", d)

    # -- the replicaset controller ----------------------------------------------------------------
    def _sync_replica_set(self, rs: dict) -> None:
        meta = rs["metadata"]
        if meta.get("deletionTimestamp"):
            return
        mine = [p for p in self.pods if owned_by(p, rs) and active(p)]
        want = rs["spec"].get("replicas", 0)
        for _ in range(want - len(mine)):
            self._create_pod(rs)
        # the extra ones: not Ready first, then the newest
        newest_first = sorted(mine, key=lambda p: p["metadata"]["creationTimestamp"], reverse=True)
        extra = sorted(newest_first, key=self.prober.ready)[:max(0, len(mine) - want)]
        for pod in extra:
            try:
                self.api.call("DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{pod['metadata']['name']}")
            except k8s.ApiException as exc:
                if exc.status != 404:
                    raise
        ready = sum(self.prober.ready(p) for p in mine)
        status = {"replicas": len(mine), "readyReplicas": ready, "availableReplicas": ready,
                  "observedGeneration": meta.get("generation", 1)}
        if {k: (rs.get("status") or {}).get(k) for k in status} != status:
            rs["status"] = status
            self.api.call("PUT", f"/apis/apps/v1/namespaces/{meta['namespace']}/replicasets/{meta['name']}/status", rs)

    def _create_pod(self, rs: dict) -> None:
        meta, template = rs["metadata"], rs["spec"]["template"]
        body = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": f"{meta['name']}-{secrets.token_hex(3)[:5]}", "namespace": meta["namespace"],
                             "labels": dict(template["metadata"].get("labels") or {}),
                             "annotations": dict(template["metadata"].get("annotations") or {}),
                             "ownerReferences": [owner_reference(rs)]},
                "spec": template["spec"]}
        try:  # refused by admission (PodSecurity, a quota): the ReplicaSet tries again next round
            self.pods.append(self.api.call("POST", f"/api/v1/namespaces/{meta['namespace']}/pods", body))
        except k8s.ApiException as exc:
            log.warning("replicaset %s: pod refused: %s", meta["name"], exc.body)

    # -- kube-proxy ---------------------------------------------------------------------------------
    def _sync_services(self, services: list[dict]) -> None:
        seen = set()
        for svc in services:
            meta, spec = svc["metadata"], svc.get("spec") or {}
            if not spec.get("selector"):
                continue
            for port in spec.get("ports") or []:
                key = (meta["namespace"], meta["name"], port["port"])
                seen.add(key)
                target = port.get("targetPort", port["port"])
                endpoints = self._endpoints_of(meta["namespace"], spec["selector"], target)
                if key not in self.proxies:
                    self.proxies[key] = ServiceProxy(endpoints)
                self.proxies[key].endpoints = endpoints  # the selector as it is now
        for key in [k for k in self.proxies if k not in seen]:
            self.proxies.pop(key).close()

    def _endpoints_of(self, namespace: str, selector: dict, target):
        """A function giving the Service's endpoints (host:port as the node reaches them) when asked."""
        return lambda: [self.reach(p, resolve_port(p, target)) for p in self.ready_pods(namespace, selector)]


def rolling_limits(replicas: int, rolling: dict) -> tuple[int, int]:
    """(maxSurge, maxUnavailable) of a RollingUpdate: percentages of replicas, surge rounded up,
    unavailable down; both 0 is read as maxUnavailable 1, as Kubernetes does."""
    def value(v, default: str, up: bool) -> int:
        v = default if v is None else v
        if isinstance(v, str) and v.endswith("%"):
            share = replicas * int(v[:-1]) / 100
            return math.ceil(share) if up else math.floor(share)
        return int(v)

    surge = value(rolling.get("maxSurge"), "25%", True)
    unavailable = value(rolling.get("maxUnavailable"), "25%", False)
    return (surge, 1) if surge == 0 and unavailable == 0 else (surge, unavailable)


class ServiceProxy:
    """One Service port on 127.0.0.1: each connection relayed to the next Ready endpoint in turn
    (none Ready: the connection is refused by closing it, as a Service without endpoints)."""

    def __init__(self, endpoints):
        self.endpoints = endpoints
        self.turn = itertools.count()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True, name=f"proxy-{self.port}").start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(conn,), daemon=True).start()

    def _relay(self, conn: socket.socket) -> None:
        try:
            backends = self.endpoints()
        except Exception:
            backends = []
        if not backends:
            conn.close()
            return
        host, port = backends[next(self.turn) % len(backends)].rsplit(":", 1)
        try:
            upstream = socket.create_connection((host, int(port)), timeout=10)
        except OSError:
            conn.close()
            return
        upstream.settimeout(None)
        threading.Thread(target=pipe, args=(upstream, conn), daemon=True).start()
        pipe(conn, upstream)

    def close(self) -> None:
        self.closed = True
        self.sock.close()


def start_apps(cluster) -> Apps:
    """The controllers with the controller manager's token, the prober with the kubelet's, on
    `cluster` (a started tests.cluster.Cluster); close() it before the cluster stops."""
    from . import KUBELET_USER

    cluster.authorizer.add_role("", "controller-manager", CONTROLLER_RULES)
    cluster.authorizer.add_binding("", {"kind": "ClusterRole", "name": "controller-manager"},
                                   [{"kind": "User", "name": CONTROLLER_USER}])
    controllers = k8s.ApiClient(cluster.configuration(cluster.authorizer.issue_token(CONTROLLER_USER)))
    prober = k8s.ApiClient(cluster.configuration(cluster.authorizer.issue_token(KUBELET_USER)))
    return Apps(controllers, prober, cluster.network).start()
