"""How the kubelet stand-in runs a container: images as this machine has them, and the process
runtime (see kubelet.py for what it gives a container, podinit.py for the namespaces part).

A container is a process group; `signal` reaches all of it (`docker kill`, `docker pause`). Its
memory limit is a memory cgroup (v1) when one can be made here: the kernel's OOM kill inside it
is what `oom_killed` reports."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

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


def venv_image(name: str, extra_path: list[str] | None = None) -> Image:
    """The project's image as this machine has it: the test's own Python environment (what
    `pip install .` put in the image). `extra_path`: host folders added to the image (at
    /image/layerN), on its PYTHONPATH."""
    env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin", "PYTHONUNBUFFERED": "1",
           "HOME": "/home/elastic", "MPLCONFIGDIR": "/tmp/matplotlib", "LANG": "C.UTF-8"}
    layers = {f"/image/layer{i}": path for i, path in enumerate(extra_path or [])}
    if layers:
        env["PYTHONPATH"] = ":".join(layers)
    return Image(name, env, paths=[sys.base_prefix] if sys.base_prefix.startswith(("/root/", "/home/", "/tmp/")) else [],
                 layers=layers)


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
            memory_limit: str | None) -> Started:
        """Start one container; `folder` is its own (made here), `binds` (host, mount path, read-only)."""
        os.makedirs(folder)
        binds = [(host, target, True) for target, host in image.layers.items()] + binds
        cgroup = self._make_cgroup(cgroup_name, memory_limit)
        log_path = os.path.join(folder, "log")
        if self.isolation == "namespaces":
            tmp = os.path.join(folder, "tmp")  # its /tmp: private, on the node (`docker cp` can read it after exit)
            os.makedirs(tmp)
            os.chmod(tmp, 0o1777)
            init = {"cgroup": cgroup, "tmp": tmp, "binds": binds, "image_paths": image.paths, "tmpfs": tmpfs, "homes": [(image.home, uid, gid)],
                    "groups": groups, "uid": uid, "gid": gid, "cwd": cwd, "argv": argv, "env": env}
            with open(os.path.join(folder, "init.json"), "w") as f:
                json.dump(init, f)
            command = ["unshare", "--mount", "--propagation", "private", sys.executable, PODINIT, os.path.join(folder, "init.json")]
            workdir, preexec, process_env = folder, None, {"PATH": "/usr/bin:/bin"}
        else:
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
            proc = subprocess.Popen(command, cwd=workdir, env=process_env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=preexec)
        return Started(proc, cgroup, log_path)

    @staticmethod
    def signal(proc: subprocess.Popen, sig: int) -> None:
        if proc.poll() is None:
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
        subprocess.Popen(["nsenter", "--target", str(proc.pid), "--mount", "--root", "--", "sh", "-c", script],
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
