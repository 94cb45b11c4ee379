"""How the kubelet stand-in runs a container: images as this machine has them, and the process
runtime (see kubelet.py for what it gives a container, podinit.py for the namespaces part).

A container is a process group; `signal` reaches all of it (`docker kill`, `docker pause`). Its
memory limit is a memory cgroup (v1) when one can be made here: the kernel's OOM kill inside it
is what `oom_killed` reports."""

from __future__ import annotations

import ctypes
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum

from .image_sources import LABEL as SOURCES_LABEL
from .image_sources import digest as sources_digest

PODINIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "podinit.py")
SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass
class Image:
    """What a container image gives a process: its ENV, USER and WORKDIR."""

    name: str
    env: dict[str, str]
    uid: int = 1000
    gid: int = 1000
    workdir: str = "/home/elastic"
    home: str = "/home/elastic"
    paths: list[str] = field(default_factory=list)  # host folders the image's files live in, if under a private folder
    layers: dict[str, str] = field(default_factory=dict)  # folder in the image -> the host folder with its files
    docker: str | None = None  # the Docker image the Docker runtime runs (its own ENV, USER, files)


def venv_image(name: str, extra_path: list[str] | None = None) -> Image:
    """The project's image as this machine has it: the test's own Python environment (what
    `pip install .` put in the image). `extra_path`: host folders added to the image (at
    /image/layerN), on its PYTHONPATH."""
    env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin", "PYTHONUNBUFFERED": "1",
           "HOME": "/home/elastic", "MPLCONFIGDIR": "/tmp/matplotlib", "LANG": "C.UTF-8"}
    layers = {f"/image/layer{i}": path for i, path in enumerate(extra_path or [])}
    if layers:
        env["PYTHONPATH"] = ":".join(layers)
    return Image(name, env, paths=python_paths(), layers=layers)


def python_paths() -> list[str]:
    """The interpreter, the venv and the project's sources (an editable install): an image's
    files where it runs this machine's Python. Those that lie under a folder a pod gets its own
    of (/root, /home, /tmp) are mounted back into the pod."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return [p for p in dict.fromkeys([sys.base_prefix, sys.prefix, repo]) if p.startswith(("/root/", "/home/", "/tmp/"))]


def parse_memory(text: str) -> int:
    from kubernetes.utils.quantity import parse_quantity

    return int(parse_quantity(text))


def memory_cgroup_parent() -> str | None:
    """A memory cgroup (v1) this process may make children in, or None."""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.strip().split(":", 2)
                if "memory" in controllers.split(","):
                    parent = f"/sys/fs/cgroup/memory{path}"
                    probe = os.path.join(parent, f"probe-{os.getpid()}")
                    os.mkdir(probe)
                    os.rmdir(probe)
                    return parent
    except OSError:
        return None
    return None


def can_isolate() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode == 0


def container_pid(proc: subprocess.Popen) -> int:
    """The node's pid of a namespaces-runtime container's PID 1: the child of its podinit."""
    try:
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            children = f.read().split()
    except OSError:
        children = []
    return int(children[0]) if children else proc.pid


PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: a forked child only calls it


class PodSpawner:
    """Starts every container of the process runtime so that it dies with this process (the
    stand-in), as a kubelet's pods go with their sandbox: a test that fails or is killed leaves no
    pod running. The kernel's parent-death signal (SIGKILL, set before exec and kept through
    nsenter, unshare and podinit, which run as root and change no credential) fires when the
    *thread* that forked the child ends, and the kubelet starts containers from short-lived
    threads (one per pod start, the monitor's restarts): so one thread of this process, which
    lives as long as the process, does every fork. podinit passes the same on to the container's
    PID 1, whose end takes its whole PID namespace; in the folders runtime (no namespaces) only the
    container's first process gets it, not what that process started."""

    def __init__(self):
        self._lock = threading.Lock()
        self._owner = 0  # the pid whose thread serves `_requests` (a forked copy of this process starts its own)
        self._requests: queue.SimpleQueue = queue.SimpleQueue()

    def popen(self, command: list[str], preexec=None, **kwargs) -> subprocess.Popen:
        with self._lock:
            if self._owner != os.getpid():
                self._owner, self._requests = os.getpid(), queue.SimpleQueue()
                threading.Thread(target=self._serve, args=(self._requests,), daemon=True, name="pod-spawner").start()
        done: Future = Future()
        self._requests.put((command, preexec, kwargs, done))
        return done.result()

    @staticmethod
    def _serve(requests: queue.SimpleQueue) -> None:
        while True:
            command, preexec, kwargs, done = requests.get()
            try:
                done.set_result(subprocess.Popen(command, preexec_fn=_dies_with(os.getpid(), preexec), **kwargs))
            except BaseException as exc:  # the caller's to handle, as from Popen itself
                done.set_exception(exc)


def _dies_with(parent: int, then=None):
    def preexec() -> None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the stand-in died between the fork and the line above
            os._exit(137)
        if then is not None:
            then()
    return preexec


SPAWNER = PodSpawner()


@dataclass
class Started:
    proc: subprocess.Popen
    cgroup: str | None
    log_path: str


class ProcessRuntime:
    def __init__(self, isolate: bool | None = None):
        self.isolation = "namespaces" if (can_isolate() if isolate is None else isolate) else "folders"
        self.cgroup_parent = memory_cgroup_parent()
        self.cgroups: set[str] = set()  # every memory cgroup made, removed at the latest on close

    @property
    def mode(self) -> str:
        return f"process ({self.isolation}; memory limits {'by cgroup' if self.cgroup_parent else 'not enforced'})"

    def run(self, folder: str, cgroup_name: str, image: Image, argv: list[str], env: dict[str, str],
            binds: list[tuple[str, str, bool]], tmpfs: list[str], uid: int, gid: int, groups: list[int], cwd: str,
            memory_limit: str | None, net=None, hostname: str | None = None) -> Started:
        """Start one container; `folder` is its own (made here), `binds` (host, mount path, read-only).
        `net`: the pod's network.PodNet (the container joins its namespace), else the node's network.
        In the namespaces runtime the container gets its own PID namespace (its command is PID 1,
        no init added, /proc its own) and its own hostname (the pod's name)."""
        os.makedirs(folder)
        binds = [(host, target, True) for target, host in image.layers.items()] + binds
        cgroup = self._make_cgroup(cgroup_name, memory_limit)
        log_path = os.path.join(folder, "log")
        if self.isolation == "namespaces":
            tmp = os.path.join(folder, "tmp")  # its /tmp: private, on the node (`docker cp` can read it after exit)
            os.makedirs(tmp)
            os.chmod(tmp, 0o1777)
            init = {"cgroup": cgroup, "tmp": tmp, "hostname": hostname, "binds": binds, "image_paths": image.paths, "tmpfs": tmpfs, "homes": [(image.home, uid, gid)],
                    "groups": groups, "uid": uid, "gid": gid, "cwd": cwd, "argv": argv, "env": env}
            with open(os.path.join(folder, "init.json"), "w") as f:
                json.dump(init, f)
            # podinit forks the container's PID 1 into the new PID namespace and stays as its parent
            # on the node (see podinit.py: `unshare --fork` of util-linux 2.38 loses a signal's exit status).
            command = [*(net.enter() if net is not None else []), "unshare", "--mount", "--propagation", "private", "--uts",
                       "--pid", sys.executable, PODINIT, os.path.join(folder, "init.json")]
            workdir, preexec, process_env = folder, None, {"PATH": "/usr/bin:/bin"}
        else:
            if net is not None:
                raise RuntimeError("pods on networks of their own need the namespaces runtime (root and unshare)")
            # No mount namespace: an own working folder and HOME; mount paths rewritten in env.
            workdir = os.path.join(folder, "home")
            os.makedirs(workdir)
            for source, target, _ in binds:
                env = {k: (source + v[len(target):] if v == target or v.startswith(target + "/") else v) for k, v in env.items()}
            sa = [s for s, t, _ in binds if t == SA_MOUNT]
            if sa:
                env["ELASTIC_STEP_SERVICEACCOUNT_DIR"] = sa[0]
            env["HOME"] = workdir
            command = [shutil.which(argv[0], path=env["PATH"]) or argv[0], *argv[1:]]
            preexec = (lambda cg=cgroup: open(os.path.join(cg, "cgroup.procs"), "w").write(str(os.getpid()))) if cgroup else None
            process_env = env
        with open(log_path, "ab") as out:
            proc = SPAWNER.popen(command, preexec, cwd=workdir, env=process_env, stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
        return Started(proc, cgroup, log_path)

    @staticmethod
    def signal(proc: subprocess.Popen, sig: int) -> None:
        # The whole group, even when its leader has exited: a container ends with every process in
        # it (its PID namespace goes with PID 1), and a server its entry point left running (as
        # `mlflow models serve` leaves uvicorn) must not outlive the pod. The group's id is not
        # reused while any member lives, so this reaches nothing else.
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    def fill_memory(self, proc: subprocess.Popen, cgroup: str | None, megabytes: int) -> None:
        """Memory pressure inside a running container (what `kubectl exec POD -- sh -c 'head -c
        ... > /dev/shm/x'` does): pages of its memory-backed /dev/shm, charged to its memory
        cgroup, which no process owns and the kernel cannot reclaim. Over the limit, the kernel's
        OOM killer kills the container's biggest process."""
        if self.isolation != "namespaces" or not cgroup:
            raise RuntimeError("filling a pod's memory needs the namespaces runtime and a memory cgroup")
        script = f"echo $$ > {cgroup}/cgroup.procs; exec head -c {megabytes * 2**20} /dev/zero > /dev/shm/.fill"
        subprocess.Popen(["nsenter", "--target", str(container_pid(proc)), "--mount", "--root", "--", "sh", "-c", script],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def _make_cgroup(self, name: str, limit: str | None) -> str | None:
        if not limit or not self.cgroup_parent:
            return None
        path = os.path.join(self.cgroup_parent, name)
        os.makedirs(path, exist_ok=True)
        self.cgroups.add(path)
        with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
            f.write(str(parse_memory(limit)))
        return path

    @staticmethod
    def oom_killed(cgroup: str | None) -> bool:
        if not cgroup:
            return False
        try:
            with open(os.path.join(cgroup, "memory.oom_control")) as f:
                return any(line.split()[0] == "oom_kill" and int(line.split()[1]) > 0 for line in f)
        except OSError:
            return False

    def remove_cgroup(self, cgroup: str | None, tries: int = 20) -> None:
        for _ in range(tries if cgroup else 0):
            try:
                os.rmdir(cgroup)
            except FileNotFoundError:
                pass
            except OSError:  # processes of it (a memory filler) still exiting
                time.sleep(0.05)
                continue
            self.cgroups.discard(cgroup)
            return

    def close(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.cgroups and time.monotonic() < deadline:
            for path in list(self.cgroups):
                self.remove_cgroup(path, tries=1)
            if self.cgroups:
                time.sleep(0.1)


# -- the Docker runtime ---------------------------------------------------------------------------
class ImageState(Enum):
    MISSING = "missing"
    STALE = "built from other sources than the checkout's"  # its label is not the checkout's digest
    CURRENT = "current"


def live_daemon(work: str) -> int | None:
    """The pid of the dockerd that runs on `work` (its pidfile there names a live dockerd), else None."""
    try:
        with open(os.path.join(work, "dockerd.pid")) as f:
            pid = int(f.read().strip())
        with open(f"/proc/{pid}/comm") as f:
            program = f.read().strip()
    except (OSError, ValueError):
        return None  # no pidfile, or a stale one: its process is gone
    return pid if program == "dockerd" else None  # a pid reused by another program is no daemon


def _started_by(pid: int) -> str:
    """The command line of `pid`'s parent (what started the daemon), for the refusal's message."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            parent = int(f.read().rpartition(")")[2].split()[1])
        with open(f"/proc/{parent}/cmdline", "rb") as f:
            command = " ".join(f.read().replace(b"\0", b" ").decode(errors="replace").split())  # one line
    except (OSError, ValueError, IndexError):
        return "a process that is gone"
    return f"pid {parent}: {command[:120]}" if parent > 1 else "a process that is gone"


class DaemonBusy(RuntimeError):
    """Another dockerd runs on this data root: two daemons on one root corrupt it."""


class DockerDaemon:
    """A Docker daemon of the test's own (as images/smoke.sh starts one): no bridge, no iptables,
    so `--network host` is the only network; its data root is image-smoke's, where `make
    image-smoke` left the built image. Stopped by its pid. It refuses to start where another
    daemon runs on the same folder (`make cluster CLUSTER_DOCKER=1`, images/smoke.sh, another
    test): a second one would take that one's socket and unmount its data root when it stops."""

    def __init__(self, work: str):
        self.work = work
        self.socket = os.path.join(work, "docker.sock")
        self.proc: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": f"unix://{self.socket}"}

    def start(self) -> "DockerDaemon":
        running = live_daemon(self.work)
        if running is not None:
            owner = _started_by(running)
            how = "`make cluster-stop`" if "cluster.local" in owner else f"`kill {running}`"
            raise DaemonBusy(f"a Docker daemon already runs on {self.work} (pid {running}, started by {owner}): stop it "
                             f"first ({how}), or give this one another folder with IMAGE_SMOKE_DIR")
        os.makedirs(self.work, exist_ok=True)
        with open(os.path.join(self.work, "dockerd.log"), "ab") as log:
            self.proc = subprocess.Popen(["dockerd", "--bridge=none", "--iptables=false", "--data-root", os.path.join(self.work, "data"),
                                          "--exec-root", os.path.join(self.work, "exec"), "--pidfile", os.path.join(self.work, "dockerd.pid"),
                                          "-H", f"unix://{self.socket}"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            # ours answers: the socket could be another daemon's, started on this folder meanwhile
            if live_daemon(self.work) == self.proc.pid and \
                    subprocess.run(["docker", "version"], env=self.env, capture_output=True).returncode == 0:
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"dockerd did not start (see {self.work}/dockerd.log)")

    def __enter__(self) -> "DockerDaemon":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def image_state(self, image: str) -> ImageState:
        """Whether `image` is here, and built from the checkout as it is now (images/smoke.sh labels
        it with image_sources.digest): an older build would run older code than the tests'."""
        found = subprocess.run(["docker", "image", "inspect", "-f", f'{{{{index .Config.Labels "{SOURCES_LABEL}"}}}}', image],
                               env=self.env, capture_output=True, text=True)
        if found.returncode != 0:
            return ImageState.MISSING
        return ImageState.CURRENT if found.stdout.strip() == sources_digest() else ImageState.STALE

    def has_image(self, image: str) -> bool:
        """`image`, built from the checkout's sources as they are now: a stale one is rebuilt (or refused) as a missing one is."""
        return self.image_state(image) is ImageState.CURRENT

    def stop(self) -> None:
        if self.proc is None:
            return  # never started (or refused): the folder may be another daemon's
        if live_daemon(self.work) not in (None, self.proc.pid):
            self.proc = None  # ours never ran: the mounts below are the live daemon's
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for mount in (os.path.join(self.work, "exec", "netns", "default"), os.path.join(self.work, "data")):
            if subprocess.run(["mountpoint", "-q", mount]).returncode == 0:
                subprocess.run(["umount", mount])
        self.proc = None


def image_smoke_dir() -> str:
    """The Docker data root holding the image `make image-smoke` builds, built there first where it
    is missing or stale (images/smoke.sh with IMAGE_SMOKE_STEPS=build: the Docker tests run their
    own jobs in it; the image's own training, DockerRunner and push checks are `make
    image-smoke`'s). No daemon is left on it."""
    from elastic_step.images import default_image

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    work = os.environ.get("IMAGE_SMOKE_DIR") or os.path.join(repo, "build", "image-smoke")
    with DockerDaemon(work).start() as daemon:
        if daemon.has_image(default_image()):
            return work
    made = subprocess.run([os.path.join(repo, "images", "smoke.sh")], capture_output=True, text=True,
                          env={**os.environ, "IMAGE_SMOKE_DIR": work, "IMAGE_SMOKE_STEPS": "build"})
    with DockerDaemon(work).start() as daemon:
        built = daemon.has_image(default_image())
    assert made.returncode == 0 and built, made.stdout[-3000:] + made.stderr[-2000:]
    return work


class DockerRuntime:
    """Each container is `docker run` of the image's Docker image (`Image.docker`), on the node's
    network (`--network host`) or, on the pod network, in its pod's sandbox container's (see `_sandbox`):
    its user, its memory limit (`--memory`, swap off: the kernel's OOM kill is Docker's
    `State.OOMKilled`), the volumes bind-mounted, its /tmp a folder on the node, its env from an
    env file (never the command line), the image's writable layer as its root. `signal`: SIGKILL is `docker kill`, SIGSTOP `docker
    pause`, SIGCONT `docker unpause`, SIGTERM `docker kill --signal TERM`. The `docker run`
    client process stands for the container (its exit status is the container's)."""

    isolation = "docker"
    cgroup_parent = None

    def __init__(self, daemon: DockerDaemon):
        self.daemon = daemon
        self.names: set[str] = set()
        self.sandboxes: dict[str, tuple[object, str]] = {}  # pod's veth -> (its network.PodNet, its sandbox container)
        self.lock = threading.Lock()

    @property
    def mode(self) -> str:
        return ("docker (docker run of the built image, --network host or on a pod network its pod's sandbox container's "
                "network; memory limits by Docker's cgroup)")

    def run(self, folder: str, cgroup_name: str, image: Image, argv: list[str], env: dict[str, str],
            binds: list[tuple[str, str, bool]], tmpfs: list[str], uid: int, gid: int, groups: list[int], cwd: str,
            memory_limit: str | None, net=None, hostname: str | None = None) -> Started:
        if not image.docker:
            raise RuntimeError(f"image {image.name} has no Docker image to run")
        network = f"container:{self._sandbox(net, image, hostname)}" if net is not None else "host"
        os.makedirs(folder)
        tmp = os.path.join(folder, "tmp")
        os.makedirs(tmp)
        os.chmod(tmp, 0o1777)
        name = f"{cgroup_name}-{os.urandom(3).hex()}"
        env_file = os.path.join(folder, "env")  # mode 600: secrets never on a command line
        with open(os.open(env_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            for key, value in env.items():
                if key != "PATH":  # the image's own
                    if "\n" in value:
                        raise RuntimeError(f"env {key}: a value with a newline cannot go into a Docker env file")
                    f.write(f"{key}={value}\n")
        command = ["docker", "run", "--name", name, "--network", network, "--user", f"{uid}:{gid}", "--env-file", env_file,
                   "--workdir", cwd, "--shm-size", "2g"]  # no --init: the command is PID 1, as in a plain image
        if not any(target.rstrip("/") == "/tmp" for _, target, _ in binds):  # else a volume is its /tmp
            command += ["-v", f"{tmp}:/tmp"]
        for group in groups:
            if group != gid:
                command += ["--group-add", str(group)]
        for target in tmpfs:
            if target != "/dev/shm":
                command += ["--tmpfs", f"{target}:mode=1777"]
        for target, host in image.layers.items():
            command += ["-v", f"{host}:{target}:ro"]
        for host, target, read_only in binds:
            command += ["-v", f"{host}:{target}{':ro' if read_only else ''}"]
        if memory_limit:
            command += ["--memory", str(parse_memory(memory_limit)), "--memory-swap", str(parse_memory(memory_limit))]
        command += ["--entrypoint", argv[0], image.docker, *argv[1:]]
        log_path = os.path.join(folder, "log")
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(command, env=self.daemon.env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        proc.container = name  # type: ignore[attr-defined]
        self.names.add(name)
        return Started(proc, name, log_path)

    def _sandbox(self, net, image: Image, hostname: str | None) -> str:
        """The pod's sandbox container, made at its first container, as Kubernetes' pause container:
        `sleep` as its PID 1, the pod's name its hostname (what the pod's /etc/hosts resolves to its
        address: gloo looks its own up), started with no network (`--network none`); the pod's network
        (network.PodNet: eth0, addresses, route, policy rules) is then moved into its namespace, and
        every container of the pod joins that (`--network container:SANDBOX`), so a restarted
        container keeps the pod's address. Removed with the pod's network."""
        with self.lock:
            known = self.sandboxes.get(net.veth)
        if known is not None:
            return known[1]
        name = f"pod-sandbox-{net.veth}-{os.urandom(3).hex()}"
        started = self._docker("run", "-d", "--name", name, "--network", "none", *(["--hostname", hostname] if hostname else []),
                               "--entrypoint", "sleep", image.docker, "infinity")
        pid = self._docker("inspect", "-f", "{{.State.Pid}}", name).stdout.strip()
        if started.returncode != 0 or not pid.isdigit() or pid == "0":
            self._docker("rm", "-f", name)
            raise RuntimeError(f"pod sandbox container {name} did not start: {started.stderr.strip()}")
        try:
            net.move_into(int(pid))
        except Exception:
            self._docker("rm", "-f", name)
            raise
        with self.lock:
            self.sandboxes[net.veth] = (net, name)
        net.on_remove.append(lambda: self._remove_sandbox(net.veth))
        return name

    def _remove_sandbox(self, veth: str) -> None:
        """The pod's network is gone (the kubelet removes it once the pod's containers all ended):
        its sandbox goes, and with it the namespace, address and veth it held."""
        with self.lock:
            _, name = self.sandboxes.pop(veth, (None, None))
        if name:
            self._docker("rm", "-f", name)

    def _docker(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["docker", *args], env=self.daemon.env, capture_output=True, text=True)

    def signal(self, proc: subprocess.Popen, sig: int) -> None:
        if proc.poll() is not None:
            return
        name = proc.container  # type: ignore[attr-defined]
        if sig == 19:  # SIGSTOP
            self._docker("pause", name)
        elif sig == 18:  # SIGCONT
            self._docker("unpause", name)
        else:
            self._docker("kill", "--signal", str(sig), name)

    def fill_memory(self, proc: subprocess.Popen, cgroup: str | None, megabytes: int) -> None:
        """`docker exec` a writer of /dev/shm (memory-backed, charged to the container's cgroup)."""
        subprocess.Popen(["docker", "exec", proc.container, "sh", "-c",  # type: ignore[attr-defined]
                          f"head -c {megabytes * 2**20} /dev/zero > /dev/shm/.fill"],
                         env=self.daemon.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def oom_killed(self, name: str | None) -> bool:
        return bool(name) and self._docker("inspect", "-f", "{{.State.OOMKilled}}", name).stdout.strip() == "true"

    def remove_cgroup(self, name: str | None, tries: int = 1) -> None:
        if name:
            self._docker("rm", "-f", name)
            self.names.discard(name)

    def close(self, timeout_s: float = 10.0) -> None:
        for name in list(self.names):
            self.remove_cgroup(name)
        with self.lock:
            sandboxes = [name for _, name in self.sandboxes.values()]
            self.sandboxes.clear()
        for name in sandboxes:
            self._docker("rm", "-f", name)


class ImageRuntime:
    """A node with two runtime handlers (as a RuntimeClass names one), chosen by the image: the
    images that name a Docker image (`Image.docker`) run on the Docker runtime, the others on the
    process runtime (namespaces), all on the same pod network. A test serves one pod as a real
    cluster would, a container of the built image, and runs the rest of its sequence faster."""

    isolation = "namespaces"  # what either gives a pod: its own /tmp, /dev/shm, hostname, network

    def __init__(self, daemon: DockerDaemon):
        self.docker, self.process = DockerRuntime(daemon), ProcessRuntime(isolate=True)
        if self.process.isolation != "namespaces":
            raise RuntimeError("the process runtime beside Docker needs namespaces (root and unshare)")

    @property
    def cgroup_parent(self) -> str | None:
        return self.process.cgroup_parent

    @property
    def mode(self) -> str:
        return f"by image: {self.docker.mode}; else {self.process.mode}"

    def _of(self, cgroup: str | None):
        return self.docker if cgroup in self.docker.names else self.process  # Docker's are container names

    def run(self, folder: str, cgroup_name: str, image: Image, *args, **kwargs) -> Started:
        return (self.docker if image.docker else self.process).run(folder, cgroup_name, image, *args, **kwargs)

    def signal(self, proc: subprocess.Popen, sig: int) -> None:
        (self.docker if hasattr(proc, "container") else self.process).signal(proc, sig)

    def fill_memory(self, proc: subprocess.Popen, cgroup: str | None, megabytes: int) -> None:
        (self.docker if hasattr(proc, "container") else self.process).fill_memory(proc, cgroup, megabytes)

    def oom_killed(self, cgroup: str | None) -> bool:
        return self._of(cgroup).oom_killed(cgroup)

    def remove_cgroup(self, cgroup: str | None, tries: int = 20) -> None:
        self._of(cgroup).remove_cgroup(cgroup, tries)

    def close(self, timeout_s: float = 10.0) -> None:
        self.docker.close(timeout_s)
        self.process.close(timeout_s)
