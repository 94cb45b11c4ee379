"""A kubelet stand-in: runs the containers of the pods the scheduler (scheduling.py) binds to
its one node, talking to the API server stand-in only through the real `kubernetes` client with its
own token, as a kubelet does — it sees the pods, Secrets and tokens the API gives it and nothing
else, and writes every status change back through the API.

Containers run as local processes (the *process runtime*, runtime.py; what a container is
given from its spec is read by podinputs.py), each with:
- its own filesystem view where the node allows it (root, `unshare --mount`: see podinit.py):
  private /tmp, /home, /run and /dev/shm, the volumes bind-mounted at their mount paths, every
  other mount read-only — so a pod cannot reach the master's job folder or another pod's files;
  without that (`isolation == "folders"`) a pod gets its own empty working folder and HOME, and
  the paths of its mounts are rewritten in its env (it could still open any path it is told,
  and it runs as the node's own user);
- the pod's user and groups (`runAsUser`, `fsGroup`, else the image's USER; namespaces only);
- its memory limit as a memory cgroup where one can be made; the kernel's OOM kill there is
  reported as `OOMKilled`, as a container runtime does;
- its env from the spec only (downward-API `fieldRef`s and `secretKeyRef`s resolved) plus the
  image's ENV and the API service variables every container gets.
The network is the node's (`--network host`: podIP = hostIP = 127.0.0.1), or with a pod network
(network.py) each pod's own namespace and address, NetworkPolicies enforced in it (netpolicy.py).

What a test does to a node: `kill(pod)` (SIGKILL: `docker kill`), `pause(pod)` (SIGSTOP the
container's processes: `docker pause`), `resume(pod)`, `fill_memory(pod, MiB)` (memory pressure
inside the pod, up to a real OOM kill). Deleting the pod object through the API
is an eviction or `kubectl delete`.
Containers restart in place as `restartPolicy` says (restarts.py); `evict(pod)` is the eviction
manager's verdict under node pressure (phase Failed, reason `Evicted`).
Not modelled: probes, image pulls (an image is known or it is
ErrImagePull), CPU limits (OMP_NUM_THREADS still follows them), a writable root layer.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

from kubernetes import client as k8s
from kubernetes import watch

from .podinputs import NODE, NODE_IP, PodInputs, StartError, expand
from .restarts import back_off_message, restart_delay
from .runtime import Image, ProcessRuntime

log = logging.getLogger("cluster.kubelet")


def pod_hostname(pod: dict) -> str:
    """The pod's hostname as the kubelet sets it: spec.hostname, else its name cut to 63 characters
    (a hostname's limit; sethostname refuses more) with a trailing '-' or '.' dropped."""
    spec, name = pod.get("spec") or {}, pod["metadata"]["name"]
    return spec.get("hostname") or name[:63].rstrip("-.")


def now_text() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Container:
    pod_uid: str
    namespace: str
    pod: str
    name: str
    image: str
    proc: subprocess.Popen
    folder: str
    cgroup: str | None
    started_at: str
    log_path: str
    exit: tuple[int, str] | None = None  # (exit code, reason) once it ended
    finished_at: str = ""
    restart_count: int = 0  # instances of this container before this one (restarts.py)
    last: "Container | None" = None  # the instance before this one
    restart_at: float | None = None  # when it ended and is to start again: the monotonic time it does


@dataclass
class PodRecord:
    uid: str
    namespace: str
    name: str
    folder: str
    containers: list[Container] = field(default_factory=list)
    init_containers: list[Container] = field(default_factory=list)
    init_failed: bool = False
    started: bool = False
    deleting_since: float | None = None
    grace_s: float = 30
    gone: bool = False  # the object is deleted from the API
    failed_to_start: str = ""
    previous: dict[str, Container] = field(default_factory=dict)  # container name -> its instance before the last restart
    pod: dict = field(default_factory=dict)  # the spec it was started from, and its volumes: what a restart reruns
    volumes: dict[str, str] = field(default_factory=dict)
    evicted: str = ""  # the eviction manager's message once the node evicted it
    net: object | None = None  # its network.PodNet on the pod network
    status_lock: threading.Lock = field(default_factory=threading.Lock)  # one status write at a time, from the newest facts


class Kubelet:
    def __init__(self, api: k8s.CoreV1Api, root: str, images: dict[str, Image], service_host: str, service_port: int,
                 isolate: bool | None = None, runtime=None, network=None, policy_agent=None):
        self.api = api
        self.root = root
        self.images = images
        self.service_env = {"KUBERNETES_SERVICE_HOST": service_host, "KUBERNETES_SERVICE_PORT": str(service_port),
                            "KUBERNETES_PORT": f"tcp://{service_host}:{service_port}"}
        self.runtime = runtime or ProcessRuntime(isolate)  # or a DockerRuntime
        self.network = network  # a network.PodNetwork: each pod its own namespace and address; else the node's network
        self.policy_agent = policy_agent  # a netpolicy.PolicyAgent enforcing NetworkPolicies on that network
        self.inputs = PodInputs(api, memory_tmpfs=self.runtime.isolation in ("namespaces", "docker"))
        self.pods: dict[str, PodRecord] = {}  # uid -> record
        self.past_logs: dict[tuple[str, str], bytes] = {}  # (namespace, pod) -> the log's tail, once the pod is gone
        self.lock = threading.RLock()
        self.closed = False
        self._watch: watch.Watch | None = None
        self._threads = [threading.Thread(target=self._watch_loop, daemon=True, name="kubelet-watch"),
                         threading.Thread(target=self._monitor_loop, daemon=True, name="kubelet-monitor")]

    @property
    def mode(self) -> str:
        return self.runtime.mode

    @property
    def isolation(self) -> str:
        return self.runtime.isolation

    @property
    def cgroup_parent(self) -> str | None:
        return self.runtime.cgroup_parent

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        self.closed = True
        if self._watch is not None:
            self._watch.stop()
        with self.lock:
            records = list(self.pods.values())
        for record in records:
            self._signal(record, signal.SIGKILL)
        for record in records:
            for c in record.init_containers + record.containers:
                try:
                    c.proc.wait(10)
                except subprocess.TimeoutExpired:
                    pass
        self.runtime.close()

    # -- what a test does to a node -----------------------------------------------------------------
    def record(self, namespace: str, name: str) -> PodRecord:
        with self.lock:
            for r in self.pods.values():
                if r.namespace == namespace and r.name == name and not r.gone:
                    return r
        raise KeyError(f"{namespace}/{name} does not run on this node")

    def kill(self, namespace: str, name: str, sig: int = signal.SIGKILL) -> None:
        self._signal(self.record(namespace, name), sig)

    def pause(self, namespace: str, name: str) -> None:
        self._signal(self.record(namespace, name), signal.SIGSTOP)

    def resume(self, namespace: str, name: str) -> None:
        self._signal(self.record(namespace, name), signal.SIGCONT)

    def evict(self, namespace: str, name: str, resource: str = "memory") -> None:
        """The node's eviction manager under pressure of `resource`: the pod's containers are killed
        and the pod is Failed with reason `Evicted` (the object stays until someone deletes it)."""
        record = self.record(namespace, name)
        record.evicted = f"The node was low on resource: {resource}. "
        for c in record.containers:
            c.restart_at = None
        self._signal(record, signal.SIGKILL)  # the status is written once the kill is seen (_check)

    def fill_memory(self, namespace: str, name: str, megabytes: int) -> None:
        """Memory pressure inside a running pod (what `kubectl exec POD -- sh -c 'head -c ... >
        /dev/shm/x'` does): pages of the pod's memory-backed /dev/shm, charged to its memory cgroup,
        which no process owns and the kernel cannot reclaim. Over the limit, the kernel's OOM
        killer kills the container's biggest process."""
        c = self.record(namespace, name).containers[0]
        self.runtime.fill_memory(c.proc, c.cgroup, megabytes)

    def volume_path(self, namespace: str, name: str, volume: str) -> str:
        """Where a pod's volume lies on the node (what an admin on the node could read)."""
        return os.path.join(self.record(namespace, name).folder, "volumes", volume)

    def container_file(self, namespace: str, name: str, container: str, path: str) -> str:
        """Where a file of a container's own /tmp lies on the node, while it runs and after it
        ended (what `docker cp` or `kubectl exec ... cat` reads); namespaces runtime only."""
        if self.isolation not in ("namespaces", "docker") or not (path == "/tmp" or path.startswith("/tmp/")):
            raise ValueError(f"only /tmp of a container of the namespaces or Docker runtime is on the node, not {path}")
        record = self.record(namespace, name)
        c = next((c for c in record.init_containers + record.containers if c.name == container), None)
        if c is None:
            raise FileNotFoundError(f"container {container} of {namespace}/{name} has not started")
        return os.path.join(c.folder, "tmp", os.path.relpath(path, "/tmp"))

    def read_log(self, namespace: str, name: str, container: str | None = None, previous: bool = False) -> bytes:
        """The pod's log (every container's, in order), or one container's (its previous instance's)."""
        from .apiserver import ApiError

        try:
            record = self.record(namespace, name)
        except KeyError:
            raise ApiError(400, "BadRequest", f'pod "{name}" has no running or finished container on this node') from None
        if container is None:
            return self._log_of(record)
        if previous:
            instance = record.previous.get(container)
            if instance is None:
                raise ApiError(400, "BadRequest", f'previous terminated container "{container}" in pod "{name}" not found')
        else:
            instance = next((c for c in record.init_containers + record.containers if c.name == container), None)
            if instance is None:
                raise ApiError(400, "BadRequest", f'container "{container}" in pod "{name}" is waiting to start: ContainerCreating')
        with open(instance.log_path, "rb") as f:
            return f.read()

    @staticmethod
    def _log_of(record: PodRecord) -> bytes:
        out = b""
        for c in record.init_containers + record.containers:
            with open(c.log_path, "rb") as f:
                out += f.read()
        return out

    def _signal(self, record: PodRecord, sig: int) -> None:
        for c in record.init_containers + record.containers:
            self.runtime.signal(c.proc, sig)

    # -- the sync loop ------------------------------------------------------------------------------
    def _watch_loop(self) -> None:
        rv = None
        while not self.closed:
            try:
                if rv is None:
                    listed = self.api.list_pod_for_all_namespaces(_preload_content=False)
                    body = json.loads(listed.data)
                    for pod in body["items"]:
                        self._sync(pod)
                    rv = body["metadata"]["resourceVersion"]
                self._watch = watch.Watch()
                for event in self._watch.stream(self.api.list_pod_for_all_namespaces, resource_version=rv, timeout_seconds=60):
                    if self.closed:
                        return
                    pod = event["raw_object"]
                    rv = pod["metadata"]["resourceVersion"]
                    if event["type"] == "DELETED":
                        self._deleted(pod)
                    else:
                        self._sync(pod)
            except k8s.ApiException as exc:
                if exc.status == 410:
                    rv = None
                    continue
                if not self.closed:
                    log.warning("kubelet watch: %s %s", exc.status, exc.reason)
                    time.sleep(0.5)
            except Exception as exc:  # a dropped watch: resume from the last version seen
                if not self.closed:
                    log.info("kubelet watch interrupted: %s", exc)
                    time.sleep(0.2)

    def _sync(self, pod: dict) -> None:
        meta, spec = pod["metadata"], pod.get("spec", {})
        if not spec.get("nodeName"):  # the scheduler's to bind (scheduling.py)
            return
        if spec["nodeName"] != NODE:
            return
        with self.lock:
            record = self.pods.get(meta["uid"])
            if record is None:
                if meta.get("deletionTimestamp") or pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                    return
                folder = os.path.join(self.root, "pods", meta["uid"])
                record = self.pods[meta["uid"]] = PodRecord(meta["uid"], meta["namespace"], meta["name"], folder)
                threading.Thread(target=self._start_pod, args=(record, pod), daemon=True, name=f"start-{meta['name']}").start()
                return
            if meta.get("deletionTimestamp") and record.deleting_since is None:
                record.deleting_since = time.monotonic()
                record.grace_s = float(meta.get("deletionGracePeriodSeconds") or 0)
                self._signal(record, signal.SIGTERM)
                self._signal(record, signal.SIGCONT)  # a paused container still gets its TERM

    def _deleted(self, pod: dict) -> None:
        with self.lock:
            record = self.pods.get(pod["metadata"]["uid"])
            if record is None:
                return
            record.gone = True
        self._signal(record, signal.SIGKILL)  # force-deleted: nothing waits for it any more

    def _monitor_loop(self) -> None:
        while not self.closed:
            time.sleep(0.05)
            with self.lock:
                records = list(self.pods.values())
            for record in records:
                try:
                    self._check(record)
                except Exception as exc:  # the API refused an update: try again next round
                    log.warning("kubelet: pod %s: %s", record.name, exc)

    def _check(self, record: PodRecord) -> None:
        if not record.started:
            return
        changed = False
        for c in record.containers:
            if c.exit is None and c.proc.poll() is not None:
                code = c.proc.returncode
                oom = self.runtime.oom_killed(c.cgroup)
                exit_code = 128 - code if code < 0 else code
                c.exit = (exit_code, "OOMKilled" if oom else ("Completed" if exit_code == 0 else "Error"))
                c.finished_at = now_text()
                self.runtime.remove_cgroup(c.cgroup)
                changed = True
                self._plan_restart(record, c)
        changed = self._stop_sidecars(record) or changed
        for index, c in enumerate(record.containers):
            if c.restart_at is not None and time.monotonic() >= c.restart_at and record.deleting_since is None and not record.gone:
                record.containers[index] = self._restart(record, c)
                changed = True
        if record.deleting_since is not None and time.monotonic() - record.deleting_since > record.grace_s:
            self._signal(record, signal.SIGKILL)
        if record.gone:
            if all(c.exit is not None for c in record.containers):
                with self.lock:
                    self.pods.pop(record.uid, None)
                try:
                    self.past_logs[(record.namespace, record.name)] = self._log_of(record)[-4000:]
                except OSError:
                    pass
                shutil.rmtree(record.folder, ignore_errors=True)
                if self.network is not None:
                    self.network.remove_pod(record.uid)
            return
        if changed:
            self._write_status(record)
        if record.deleting_since is not None and all(c.exit is not None for c in record.containers):
            try:  # the kubelet's final delete: the object goes once its containers stopped
                self.api.delete_namespaced_pod(record.name, record.namespace, grace_period_seconds=0, _preload_content=False)
            except k8s.ApiException as exc:
                if exc.status != 404:
                    raise
            record.gone = True

    def _stop_sidecars(self, record: PodRecord) -> bool:
        """Native sidecars (init containers with restartPolicy Always) get SIGTERM once every
        container of the pod has ended for good, as the kubelet ends them; True when one ended."""
        sidecars = [c for c in record.init_containers if c.exit is None]
        if not sidecars or not record.containers or any(c.exit is None or c.restart_at is not None for c in record.containers):
            return False
        ended = False
        for c in sidecars:
            if c.proc.poll() is not None:
                code = c.proc.returncode
                c.exit, c.finished_at = (128 - code if code < 0 else code, "Completed" if code == 0 else "Error"), now_text()
                self.runtime.remove_cgroup(c.cgroup)
                ended = True
            elif time.monotonic() - getattr(c, "stopping", 0.0) > 1:
                # Again each second: Istio's startupProbe, which holds the pod's containers back until
                # the proxy is up, is not played, so a TERM may come before the proxy handles it.
                c.stopping = time.monotonic()
                self.runtime.signal(c.proc, signal.SIGTERM)
        return ended

    # -- restarts in place (restarts.py) -------------------------------------------------------------
    def _plan_restart(self, record: PodRecord, c: Container) -> None:
        policy = record.pod.get("spec", {}).get("restartPolicy", "Always")
        delay = restart_delay(policy, c.exit[0], c.restart_count)
        if delay is not None and record.deleting_since is None and not record.gone and not record.evicted:
            c.restart_at = time.monotonic() + delay

    def _restart(self, record: PodRecord, ended: Container) -> Container:
        spec = next(c for c in record.pod["spec"]["containers"] if c["name"] == ended.name)
        fresh = self._run(record, record.pod, spec, record.volumes, ended.restart_count + 1)
        fresh.restart_count, fresh.last = ended.restart_count + 1, ended
        ended.restart_at = None
        record.previous[ended.name] = ended
        return fresh

    # -- statuses -----------------------------------------------------------------------------------
    @staticmethod
    def _terminated(c: Container) -> dict:
        return {"terminated": {"exitCode": c.exit[0], "reason": c.exit[1], "startedAt": c.started_at,
                               "finishedAt": c.finished_at, "containerID": f"process://{c.proc.pid}"}}

    def _container_status(self, c: Container, record: PodRecord | None = None) -> dict:
        status = {"name": c.name, "image": c.image, "imageID": f"process://{c.image}", "containerID": f"process://{c.proc.pid}",
                  "restartCount": c.restart_count, "ready": c.exit is None, "started": c.exit is None}
        if c.exit is None:
            status["state"] = {"running": {"startedAt": c.started_at}}
        elif c.restart_at is not None and record is not None:  # ended, to start again after its back-off
            message = back_off_message(max(0.0, c.restart_at - time.monotonic()), c.name, record.name, record.namespace, record.uid)
            status["state"] = {"waiting": {"reason": "CrashLoopBackOff", "message": message}}
            status["lastState"] = self._terminated(c)
        else:
            status["state"] = self._terminated(c)
        if c.last is not None and "lastState" not in status:
            status["lastState"] = self._terminated(c.last)
        return status

    def _write_status(self, record: PodRecord, waiting: tuple[str, str] | None = None) -> None:
        with record.status_lock:
            self._write_status_locked(record, waiting)

    def _write_status_locked(self, record: PodRecord, waiting: tuple[str, str] | None) -> None:
        for _ in range(5):
            current = json.loads(self.api.read_namespaced_pod(record.name, record.namespace, _preload_content=False).data)
            if current["metadata"]["uid"] != record.uid:
                return
            status = current.setdefault("status", {})
            ips = record.net.ips if record.net is not None else [NODE_IP]
            status.update(hostIP=NODE_IP, podIP=ips[0], podIPs=[{"ip": a} for a in ips], startTime=status.get("startTime") or now_text())
            if waiting:
                status["phase"] = "Pending"
                status["containerStatuses"] = [
                    {"name": c["name"], "image": c["image"], "imageID": "", "restartCount": 0, "ready": False, "started": False,
                     "state": {"waiting": {"reason": waiting[0], "message": waiting[1]}}}
                    for c in current["spec"]["containers"]]
            elif record.init_failed:
                status["phase"] = "Failed"
            else:
                exits = [None if c.restart_at is not None else c.exit for c in record.containers]  # to restart: still running
                if not exits:
                    status["phase"] = "Pending"  # init containers still running
                elif all(e is not None for e in exits):
                    status["phase"] = "Succeeded" if all(e[0] == 0 for e in exits) else "Failed"
                else:
                    status["phase"] = "Running"
                status["containerStatuses"] = [self._container_status(c, record) for c in record.containers]
            if record.init_containers:
                status["initContainerStatuses"] = [self._container_status(c) for c in record.init_containers]
            ready = "True" if status["phase"] == "Running" else "False"
            conditions = [c for c in status.get("conditions", []) if c["type"] not in ("Ready", "ContainersReady", "Initialized")]
            conditions += [{"type": "Initialized", "status": "True", "lastTransitionTime": now_text()},
                           {"type": "Ready", "status": ready, "lastTransitionTime": now_text()},
                           {"type": "ContainersReady", "status": ready, "lastTransitionTime": now_text()}]
            if record.evicted:  # the eviction manager's verdict: Failed, with its reason, never restarted
                status.update(phase="Failed", reason="Evicted", message=record.evicted)
                conditions = [c for c in conditions if c["type"] != "DisruptionTarget"] + [
                    {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet",
                     "message": record.evicted, "lastTransitionTime": now_text()}]
            status["conditions"] = conditions
            try:
                self.api.replace_namespaced_pod_status(record.name, record.namespace, current, _preload_content=False)
                return
            except k8s.ApiException as exc:
                if exc.status == 404:
                    return
                if exc.status != 409:
                    raise

    # -- starting a pod -----------------------------------------------------------------------------
    def _start_pod(self, record: PodRecord, pod: dict) -> None:
        try:
            self._start_containers(record, pod)
        except StartError as exc:
            record.failed_to_start = str(exc)
            log.info("pod %s cannot start: %s", record.name, exc)
            self._write_status(record, waiting=(exc.reason, str(exc)))
            record.started = True  # nothing runs: the monitor only finishes a deletion
            return
        record.started = True
        if record.deleting_since is not None or record.gone:
            self._signal(record, signal.SIGKILL)
        self._write_status(record)

    def _start_containers(self, record: PodRecord, pod: dict) -> None:
        spec = pod["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            if c["image"] not in self.images:
                raise StartError("ErrImagePull", f'failed to pull image "{c["image"]}": not found')
        os.makedirs(os.path.join(record.folder, "volumes"), exist_ok=True)
        if self.network is not None:
            self._join_network(record, pod)
        fs_group = (spec.get("securityContext") or {}).get("fsGroup")
        volumes = {v["name"]: self.inputs.make_volume(os.path.join(record.folder, "volumes", v["name"]), pod, v, fs_group)
                   for v in spec.get("volumes") or []}
        for c in spec.get("initContainers", []):  # one after the other, each to a successful end
            container = self._run(record, pod, c, volumes)
            record.init_containers.append(container)
            if c.get("restartPolicy") == "Always":  # a native sidecar (KEP-753): runs beside what follows it
                continue
            container.proc.wait()
            code = container.proc.returncode
            container.exit = (128 - code if code < 0 else code, "Completed" if code == 0 else "Error")
            container.finished_at = now_text()
            self.runtime.remove_cgroup(container.cgroup)
            if code != 0 or record.deleting_since is not None or record.gone:
                record.init_failed = True
                return
            self._write_status(record)
        record.pod, record.volumes = pod, volumes  # what a restart in place runs again
        for c in spec["containers"]:
            record.containers.append(self._run(record, pod, c, volumes))

    def _join_network(self, record: PodRecord, pod: dict) -> None:
        """The pod's sandbox: its namespace and address, its /etc/hosts (its name -> its address,
        as the kubelet writes it), and the policies that select it enforced before anything runs."""
        record.net = self.network.add_pod(record.uid)
        pod.setdefault("status", {})["podIP"] = record.net.ip  # what the downward API's status.podIP gives
        with open(os.path.join(record.folder, "hosts"), "w") as f:
            f.write(f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n{record.net.ip}\t{pod_hostname(pod)}\n")
        if self.policy_agent is not None:
            try:
                self.policy_agent.sync()
            except Exception as exc:  # the agent's next round enforces it
                log.warning("network policies for %s not synced yet: %s", record.name, exc)

    def _run(self, record: PodRecord, pod: dict, c: dict, volumes: dict[str, str], restarts: int = 0) -> Container:
        """One container of the pod, as its spec and its image say."""
        spec = pod["spec"]
        security = spec.get("securityContext") or {}
        fs_group = security.get("fsGroup")
        image = self.images[c["image"]]
        csec = {**security, **(c.get("securityContext") or {})}
        uid = csec.get("runAsUser", image.uid)
        gid = csec.get("runAsGroup", image.gid)
        groups = sorted({gid, *([fs_group] if fs_group is not None else []), *security.get("supplementalGroups", [])})
        env = {**image.env, **self.service_env, **self.inputs.env(pod, c)}
        binds, tmpfs = [], []
        for m in c.get("volumeMounts") or []:
            source = volumes[m["name"]]
            if source == "tmpfs":
                tmpfs.append(m["mountPath"])
            else:
                path = os.path.join(source, m.get("subPath", "")).rstrip("/")
                os.makedirs(path, exist_ok=True)  # a subPath that does not exist yet is created, as the kubelet does
                binds.append((path, m["mountPath"], bool(m.get("readOnly"))))
        # $(VAR) in command and args is expanded from the container's env, as Kubernetes does
        argv = [expand(a, env) for a in list(c.get("command") or []) + list(c.get("args") or [])]
        if not argv:
            raise StartError("CreateContainerError", f"container {c['name']}: no command (process images have no ENTRYPOINT)")
        limit = ((c.get("resources") or {}).get("limits") or {}).get("memory")
        if record.net is not None:
            binds.append((os.path.join(record.folder, "hosts"), "/etc/hosts", True))
        # a restarted container is a new one: its own folder, log and name (its predecessor's log stays readable)
        instance = c["name"] + (f"-{restarts}" if restarts else "")
        started = self.runtime.run(os.path.join(record.folder, "containers", instance), f"pod-{record.uid[:8]}-{instance}",
                                   image, argv, env, binds, tmpfs, uid, gid, groups, c.get("workingDir") or image.workdir, limit,
                                   net=record.net, hostname=pod_hostname(pod) if self.isolation in ("namespaces", "docker") else None)
        return Container(record.uid, record.namespace, record.name, c["name"], c["image"], started.proc,
                         os.path.dirname(started.log_path), started.cgroup, now_text(), started.log_path)
