"""What stands in for the Kubernetes API server in tests: a fake CoreV1Api at the client
boundary. Its pods are real local processes started with the pod's own command and env; the
token Secret is written to a temporary folder standing in for the mounted volume; the job's
NetworkPolicies are kept as objects (nothing enforces them here). Every call records the
request timeout it was given, and `stall_s` makes pod calls hang as a stalled API server
does (until the caller's timeout). Pod status
changes become watch events, streamed as the API server streams them (JSON lines), so the
client's own Watch parses them into V1Pod objects; a resume from a compacted resourceVersion
gets a 410 Gone. What it does not model: scheduling, nodes, the kubelet's restarts, quotas."""

from __future__ import annotations

import base64
import copy
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

from kubernetes import client as k8s

SERIALIZER = k8s.ApiClient()


def api_error(status: int, reason: str) -> k8s.ApiException:
    return k8s.ApiException(status=status, reason=reason)


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def matches(labels: dict | None, selector: str | None) -> bool:
    for term in filter(None, (selector or "").split(",")):
        key, _, value = term.partition("=")
        if (labels or {}).get(key) != value:
            return False
    return True


@dataclass
class FakePod:
    pod: k8s.V1Pod
    proc: subprocess.Popen | None = None
    mount_dir: str = ""
    oom: bool = False
    disruption: tuple[str, str] | None = None  # (pod reason, DisruptionTarget reason) of an eviction/preemption
    delete_when_done: bool = False


@dataclass
class FakeCoreV1Api:
    workdir: str
    missing_images: set[str] = field(default_factory=set)
    unschedulable: str | None = None  # a scheduler message: new pods stay Pending with it
    python_bin: str = os.path.dirname(sys.executable)

    def __post_init__(self):
        self.cond = threading.Condition()
        self.rv = 100
        self.history: list[tuple[int, str, dict]] = []
        self.oldest_rv = 0  # resuming a watch from before this is 410 Gone
        self.stream_generation = 0  # bumping it ends every open watch (a dropped connection)
        self.pods: dict[str, FakePod] = {}
        self.secrets: dict[str, k8s.V1Secret] = {}
        self.network_policies: dict[str, k8s.V1NetworkPolicy] = {}
        self.config_maps: dict[str, k8s.V1ConfigMap] = {}
        self.created_network_policies: list[k8s.V1NetworkPolicy] = []  # as received
        self.calls: list[tuple[str, str]] = []
        self.request_timeouts: list[tuple[str, object]] = []  # (call, its _request_timeout)
        self.stall_s = 0.0  # pod create/delete calls hang this long (a stalled API server)
        self.created: list[k8s.V1Pod] = []  # every pod manifest as received
        self.closed = False
        self._monitor = threading.Thread(target=self._watch_processes, daemon=True)
        self._monitor.start()

    # -- bookkeeping ----------------------------------------------------------------------------
    def _event(self, kind: str, record: FakePod) -> None:
        self.rv += 1
        record.pod.metadata.resource_version = str(self.rv)
        self.history.append((self.rv, kind, SERIALIZER.sanitize_for_serialization(record.pod)))
        self.cond.notify_all()

    def _status(self, record: FakePod, phase: str, **container_state) -> None:
        status = record.pod.status
        status.phase = phase
        if container_state:
            container = record.pod.spec.containers[0]
            status.container_statuses = [k8s.V1ContainerStatus(
                name=container.name, image=container.image, image_id="", ready=phase == "Running",
                restart_count=0, state=k8s.V1ContainerState(**container_state),
            )]

    def _timed(self, call: str, kwargs: dict, stalls: bool = False) -> None:
        """Record the call's request timeout; a stalled server answers after `stall_s`, or never
        within the caller's timeout (which then ends the call, as urllib3 does)."""
        timeout = kwargs.get("_request_timeout")
        self.request_timeouts.append((call, timeout))
        if stalls and self.stall_s:
            limit = timeout if isinstance(timeout, (int, float)) else (timeout[1] if timeout else None)
            time.sleep(min(self.stall_s, limit) if limit else self.stall_s)
            if limit and self.stall_s > limit:
                import urllib3

                raise urllib3.exceptions.ReadTimeoutError(None, call, f"Read timed out. (read timeout={limit})")

    # -- Secrets --------------------------------------------------------------------------------
    def create_self_subject_access_review(self, body, **kwargs):
        """The master's permission pre-flight: this fake models no RBAC, so every right is granted
        (tests/cluster's API server answers from the real Roles)."""
        self.calls.append(("review", body.spec.resource_attributes.resource))
        return k8s.V1SelfSubjectAccessReview(spec=body.spec, status=k8s.V1SubjectAccessReviewStatus(allowed=True))

    def create_namespaced_secret(self, namespace, body, **kwargs):
        self._timed("create_secret", kwargs)
        with self.cond:
            self.calls.append(("create_secret", body.metadata.name))
            if body.metadata.name in self.secrets:
                raise api_error(409, "AlreadyExists")
            self.secrets[body.metadata.name] = copy.deepcopy(body)
            return body

    def delete_namespaced_secret(self, name, namespace, **kwargs):
        self._timed("delete_secret", kwargs)
        with self.cond:
            self.calls.append(("delete_secret", name))
            if self.secrets.pop(name, None) is None:
                raise api_error(404, "NotFound")

    # -- NetworkPolicies (networking.k8s.io; the backend uses this object for both groups) ------
    def create_namespaced_network_policy(self, namespace, body, **kwargs):
        self._timed("create_network_policy", kwargs)
        with self.cond:
            self.calls.append(("create_network_policy", body.metadata.name))
            if body.metadata.name in self.network_policies:
                raise api_error(409, "AlreadyExists")
            self.network_policies[body.metadata.name] = copy.deepcopy(body)
            self.created_network_policies.append(copy.deepcopy(body))
            return body

    def delete_namespaced_network_policy(self, name, namespace, **kwargs):
        self._timed("delete_network_policy", kwargs)
        with self.cond:
            self.calls.append(("delete_network_policy", name))
            if self.network_policies.pop(name, None) is None:
                raise api_error(404, "NotFound")

    # -- ConfigMaps (the job's published status) -------------------------------------------------
    def create_namespaced_config_map(self, namespace, body, **kwargs):
        self._timed("create_config_map", kwargs)
        with self.cond:
            self.calls.append(("create_config_map", body.metadata.name))
            if body.metadata.name in self.config_maps:
                raise api_error(409, "AlreadyExists")
            self.config_maps[body.metadata.name] = copy.deepcopy(body)
            return copy.deepcopy(body)

    def patch_namespaced_config_map(self, name, namespace, body, **kwargs):
        self._timed("patch_config_map", kwargs)
        with self.cond:
            self.calls.append(("patch_config_map", name))
            found = self.config_maps.get(name)
            if found is None:
                raise api_error(404, "NotFound")
            found.data = {**(found.data or {}), **body.get("data", {})}
            annotations = body.get("metadata", {}).get("annotations")
            if annotations:
                found.metadata.annotations = {**(found.metadata.annotations or {}), **annotations}
            return copy.deepcopy(found)

    def list_namespaced_config_map(self, namespace, label_selector=None, **kwargs):
        with self.cond:
            return k8s.V1ConfigMapList(items=[copy.deepcopy(m) for m in self.config_maps.values()
                                              if matches(m.metadata.labels, label_selector)])

    def delete_namespaced_config_map(self, name, namespace, **kwargs):
        self._timed("delete_config_map", kwargs)
        with self.cond:
            self.calls.append(("delete_config_map", name))
            if self.config_maps.pop(name, None) is None:
                raise api_error(404, "NotFound")

    # -- Pods -----------------------------------------------------------------------------------
    def add_master_pod(self, name: str, image: str, namespace: str = "ml", containers: list[k8s.V1Container] | None = None,
                       service_account: str = "elastic-step-runner") -> k8s.V1Pod:
        """The step pod the master runs in, shaped as Argo makes it: its `wait` sidecar listed
        before the `main` container."""
        containers = containers or [k8s.V1Container(name="wait", image="quay.io/argoproj/argoexec:v3.7.1"),
                                    k8s.V1Container(name="main", image=image)]
        labels = {"workflows.argoproj.io/workflow": "train-wf", "workflows.argoproj.io/completed": "false"}
        pod = k8s.V1Pod(metadata=k8s.V1ObjectMeta(name=name, namespace=namespace, uid=str(uuid.uuid4()), labels=labels),
                        spec=k8s.V1PodSpec(containers=containers, service_account_name=service_account),
                        status=k8s.V1PodStatus(phase="Running", pod_ip="127.0.0.1"))
        with self.cond:
            self.pods[name] = FakePod(pod)
            self._event("ADDED", self.pods[name])
        return pod

    def read_namespaced_pod(self, name, namespace, **kwargs):
        self._timed("read_pod", kwargs)
        with self.cond:
            if name not in self.pods or self.pods[name].pod.metadata.namespace not in (None, namespace):
                raise api_error(404, "NotFound")
            return copy.deepcopy(self.pods[name].pod)

    def create_namespaced_pod(self, namespace, body, **kwargs):
        self._timed("create_pod", kwargs, stalls=True)
        with self.cond:
            name = body.metadata.name
            self.calls.append(("create_pod", name))
            if name in self.pods:
                raise api_error(409, "AlreadyExists")
            self.created.append(copy.deepcopy(body))
            pod = copy.deepcopy(body)
            pod.metadata.uid = str(uuid.uuid4())
            pod.metadata.namespace = namespace
            pod.metadata.creation_timestamp = now()
            pod.status = k8s.V1PodStatus(phase="Pending")
            record = FakePod(pod)
            self.pods[name] = record
            self._event("ADDED", record)
            image = pod.spec.containers[0].image
            if self.unschedulable:
                pod.status.conditions = [k8s.V1PodCondition(type="PodScheduled", status="False", reason="Unschedulable",
                                                            message=self.unschedulable)]
            elif image in self.missing_images:
                pod.spec.node_name = "fake-node"
                self._status(record, "Pending", waiting=k8s.V1ContainerStateWaiting(
                    reason="ErrImagePull", message=f'failed to pull image "{image}": not found'))
            else:
                pod.spec.node_name = "fake-node"
                self._start(record)
            self._event("MODIFIED", record)
            return copy.deepcopy(pod)

    def _start(self, record: FakePod) -> None:
        pod = record.pod
        container = pod.spec.containers[0]
        record.mount_dir = os.path.join(self.workdir, pod.metadata.name)
        os.makedirs(record.mount_dir, exist_ok=True)
        mounts = {}  # the container's mount path -> the folder standing in for it
        volumes = {v.name: v for v in pod.spec.volumes or []}
        for mount in container.volume_mounts or []:
            volume = volumes[mount.name]
            if volume.secret is not None:
                secret = self.secrets[volume.secret.secret_name]
                folder = os.path.join(record.mount_dir, volume.name)
                os.makedirs(folder, exist_ok=True)
                for key, value in (secret.data or {}).items():
                    path = os.path.join(folder, key)
                    with open(path, "wb") as f:
                        f.write(base64.b64decode(value))
                    os.chmod(path, volume.secret.default_mode or 0o644)
                mounts[mount.mount_path] = folder
        env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_STEP_")}
        for var in container.env or []:
            value = var.value or ""
            for mount_path, folder in mounts.items():
                if value.startswith(mount_path + "/"):
                    value = folder + value[len(mount_path):]
            env[var.name] = value
        # The pod's own network is this machine's loopback; the scratch volume is a folder.
        env["GLOO_SOCKET_IFNAME"] = "lo"
        env["HOME"] = env["MPLCONFIGDIR"] = record.mount_dir
        command = list(container.command) + list(container.args or [])
        command[0] = shutil.which(command[0], path=self.python_bin) or command[0]
        log = open(os.path.join(record.mount_dir, "log"), "ab")
        record.proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        pod.status.pod_ip = "127.0.0.1"
        self._status(record, "Running", running=k8s.V1ContainerStateRunning(started_at=now()))

    def delete_namespaced_pod(self, name, namespace, grace_period_seconds=None, **kwargs):
        self._timed("delete_pod", kwargs, stalls=True)
        with self.cond:
            self.calls.append(("delete_pod", name))
            record = self.pods.get(name)
            if record is None:
                raise api_error(404, "NotFound")
            if record.pod.metadata.deletion_timestamp is None:
                record.pod.metadata.deletion_timestamp = now()
                self._event("MODIFIED", record)
            record.delete_when_done = True
            if record.proc is not None and record.proc.poll() is None:
                record.proc.send_signal(signal.SIGKILL if grace_period_seconds == 0 else signal.SIGTERM)
            elif record.proc is None or record.pod.status.phase in ("Succeeded", "Failed"):
                self._remove(record)  # nothing left running: gone at once
            return k8s.V1Status(status="Success")

    def _remove(self, record: FakePod) -> None:
        del self.pods[record.pod.metadata.name]
        self._event("DELETED", record)

    def list_namespaced_pod(self, namespace, label_selector=None, watch=False, resource_version=None,
                            timeout_seconds=None, _preload_content=True, **kwargs):
        self._timed("watch" if watch else "list", kwargs)
        if watch and not timeout_seconds:
            raise AssertionError("a watch without timeout_seconds can hang forever after a network cut")
        with self.cond:
            if watch:
                self.calls.append(("watch", str(resource_version)))
                return FakeWatchResponse(self, label_selector, int(resource_version or 0), timeout_seconds or 30)
            self.calls.append(("list", label_selector or ""))
            items = [copy.deepcopy(r.pod) for r in self.pods.values() if matches(r.pod.metadata.labels, label_selector)]
            return k8s.V1PodList(items=items, metadata=k8s.V1ListMeta(resource_version=str(self.rv)))

    # -- what the cluster does on its own ---------------------------------------------------------
    def oom_kill(self, name: str) -> None:
        """The kernel kills the container at its memory limit."""
        with self.cond:
            record = self.pods[name]
            record.oom = True
            record.proc.kill()

    def evict(self, name: str, preempt: bool = False) -> None:
        """Node-pressure eviction or scheduler preemption: DisruptionTarget, then the pod is deleted."""
        with self.cond:
            record = self.pods[name]
            record.disruption = ("Preempting", "PreemptionByScheduler") if preempt else ("Evicted", "TerminationByKubelet")
            record.pod.status.conditions = [k8s.V1PodCondition(type="DisruptionTarget", status="True", reason=record.disruption[1],
                                                               message="fake cluster")]
            self._event("MODIFIED", record)
            record.delete_when_done = True
            record.proc.kill()

    def vanish(self, name: str) -> None:
        """The pod goes while no watch is open and the history is compacted: only a re-list can tell."""
        with self.cond:
            record = self.pods.pop(name)
            if record.proc is not None:
                record.proc.kill()
            self.rv += 1
            self.oldest_rv = self.rv + 1
            self.stream_generation += 1
            self.cond.notify_all()

    def compact(self) -> None:
        """The server forgets its history and drops every open watch: resumes get 410 Gone."""
        with self.cond:
            self.oldest_rv = self.rv + 1
            self.stream_generation += 1
            self.cond.notify_all()

    def _watch_processes(self) -> None:
        while not self.closed:
            with self.cond:
                for record in list(self.pods.values()):
                    code = record.proc.poll() if record.proc is not None else None
                    if code is None or record.pod.status.phase in ("Succeeded", "Failed"):
                        continue
                    exit_code = 128 - code if code < 0 else code
                    reason = "OOMKilled" if record.oom else ("Completed" if code == 0 else "Error")
                    if record.disruption:
                        record.pod.status.reason = record.disruption[0]
                    self._status(record, "Succeeded" if code == 0 and not record.disruption else "Failed",
                                 terminated=k8s.V1ContainerStateTerminated(exit_code=exit_code, reason=reason, finished_at=now()))
                    self._event("MODIFIED", record)
                    if record.delete_when_done:
                        self._remove(record)
            time.sleep(0.05)

    # -- for assertions ---------------------------------------------------------------------------
    def worker_pods(self) -> dict[str, FakePod]:
        with self.cond:
            return {n: r for n, r in self.pods.items() if (r.pod.metadata.labels or {}).get("app.kubernetes.io/component") == "worker"}

    def wait_until_no_worker_pods(self, timeout: float = 15.0) -> dict[str, FakePod]:
        """Deletion is asynchronous (the processes must end first): what is left after `timeout`."""
        deadline = time.monotonic() + timeout
        while self.worker_pods() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.worker_pods()

    def pod_of(self, worker_id: str) -> str:
        for pod in reversed(self.created):
            if any(e.name == "ELASTIC_STEP_WORKER_ID" and e.value == worker_id for e in pod.spec.containers[0].env):
                return pod.metadata.name
        raise KeyError(worker_id)

    def close(self) -> None:
        self.closed = True
        with self.cond:
            for record in self.pods.values():
                if record.proc is not None and record.proc.poll() is None:
                    record.proc.kill()
            self.stream_generation += 1
            self.cond.notify_all()
        for record in list(self.pods.values()):
            if record.proc is not None:
                record.proc.wait()


class FakeWatchResponse:
    """The object `list_namespaced_pod(watch=True, _preload_content=False)` returns: the
    client's Watch reads newline-separated JSON events from `stream()`."""

    def __init__(self, api: FakeCoreV1Api, selector: str | None, resource_version: int, timeout_s: float):
        self.api, self.selector, self.cursor = api, selector, resource_version
        self.deadline = time.monotonic() + timeout_s
        self.generation = api.stream_generation

    def stream(self, amt=None, decode_content=False):
        api = self.api
        with api.cond:
            if self.cursor < api.oldest_rv:
                gone = {"kind": "Status", "status": "Failure", "reason": "Expired", "code": 410,
                        "message": f"too old resource version: {self.cursor} ({api.oldest_rv})"}
                yield (json.dumps({"type": "ERROR", "object": gone}) + "\n").encode()
                return
        while True:
            with api.cond:
                if api.stream_generation != self.generation:
                    return  # the connection was dropped: nothing more arrives on it
                pending = [e for e in api.history if e[0] > self.cursor and matches(e[2]["metadata"].get("labels"), self.selector)]
                if not pending:
                    if time.monotonic() > self.deadline:
                        return
                    api.cond.wait(0.2)
                    continue
                self.cursor = max(e[0] for e in api.history)
            for _, kind, obj in pending:
                yield (json.dumps({"type": kind, "object": obj}) + "\n").encode()

    def close(self):
        pass

    def release_conn(self):
        pass
