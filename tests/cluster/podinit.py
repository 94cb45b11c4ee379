"""The process runtime's container init: run as root inside a fresh mount namespace (`unshare
--mount`), it gives the container its own filesystem view, then becomes the container's command.

- joins the pod's memory cgroup first, so everything the container allocates is charged there;
- mounts private tmpfs over /tmp, /home, /root, /run (= /var/run) and /dev/shm: another pod's
  files, the master's job folder and the test's own temporary folders are out of sight; the
  image's own files that live under them (an interpreter under /root) are bound back read-only;
- bind-mounts each volume (Secret, emptyDir, the service-account token) at its mount path;
- makes every other mount read-only (a container's root filesystem is never the node's);
- drops to the pod's user and groups, changes to the working folder and execs the command.

Usage: python podinit.py SPEC.json  (written by kubelet.py; see ProcessRuntime.start)
"""

import json
import os
import subprocess
import sys

PRIVATE = ("/tmp", "/home", "/root", "/dev/shm")  # /run is made private first: it holds the staging area
STAGE = "/run/.stage"


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, stdout=subprocess.DEVNULL)


def private_target(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in PRIVATE + ("/run",))


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    if spec.get("cgroup"):
        with open(os.path.join(spec["cgroup"], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    mount("-t", "tmpfs", "-o", "mode=0755", "tmpfs", "/run")
    staged = []
    for i, (source, target, read_only) in enumerate(spec["binds"]):
        stage = f"{STAGE}/{i}"
        os.makedirs(stage)
        mount("--bind", source, stage)
        staged.append((stage, os.path.realpath(target), read_only))  # /var/run is /run
    for i, path in enumerate(spec.get("image_paths", [])):
        stage = f"{STAGE}/image-{i}"
        os.makedirs(stage)
        mount("--bind", path, stage)
        staged.append((stage, path, True))
    for path in PRIVATE:
        mount("-t", "tmpfs", "-o", "mode=1777" if path in ("/tmp", "/dev/shm") else "mode=0755", "tmpfs", path)
    for path, uid, gid in spec.get("homes", []):
        os.makedirs(path, exist_ok=True)
        os.chown(path, uid, gid)
    for target in map(os.path.realpath, spec.get("tmpfs", [])):
        if not private_target(target):
            sys.exit(f"podinit: mount path {target} is outside the container's private folders")
        os.makedirs(target, exist_ok=True)
        mount("-t", "tmpfs", "-o", "mode=1777", "tmpfs", target)
    for stage, target, read_only in sorted(staged, key=lambda s: s[1].count("/")):
        if not private_target(target):
            sys.exit(f"podinit: mount path {target} is outside the container's private folders")
        os.makedirs(target, exist_ok=True)
        mount("--bind", stage, target)
        if read_only:
            mount("-o", "remount,bind,ro", target)
    for stage, _, _ in staged:
        subprocess.run(["umount", "-l", stage], check=True)
    ours = set(PRIVATE) | {"/run"} | {t for _, t, _ in staged} | set(map(os.path.realpath, spec.get("tmpfs", [])))
    with open("/proc/self/mounts") as f:
        targets = [line.split()[1] for line in f]
    for target in targets:
        if target in ours or any(target.startswith(p) for p in ("/proc", "/sys", "/dev")):
            continue
        subprocess.run(["mount", "-o", "remount,bind,ro", target], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.setgroups(spec["groups"])
    os.setgid(spec["gid"])
    os.setuid(spec["uid"])
    os.chdir(spec["cwd"])
    os.execvpe(spec["argv"][0], spec["argv"], spec["env"])


if __name__ == "__main__":
    main(sys.argv[1])
