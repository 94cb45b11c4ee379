"""The process runtime's container init: run as root inside a fresh mount namespace (`unshare
--mount`), it builds the container's own root filesystem, then becomes the container's command.

- joins the pod's memory cgroup first, so everything the container allocates is charged there;
- builds a new root (a tmpfs): the node's top-level folders bound in read-only (a container's
  root filesystem is never the node's to write), but a private, empty /tmp (a folder of the
  container's on the node, which outlives it as a stopped container's writable layer does) and
  private, empty tmpfs for /home, /root, /run (= /var/run) and /dev/shm — so another pod's files, the master's job folder and the
  test's own temporary folders are out of sight; the image's own files that live under them (an
  interpreter under /root, a layer folder) are bound back read-only;
- binds each volume (Secret, emptyDir, the service-account token) at its mount path, which may
  be a new top-level folder (/argo, /data) but never a new folder inside one of the node's;
- chroots into it, drops to the pod's user and groups, changes to the working folder and execs.

Started by `unshare --pid` (no fork), it forks the container's first process, which is PID 1 of
the new PID namespace, mounts that namespace's own /proc and becomes the command: PID 1 with no
init added, seeing only its container's processes. The parent stays on the node as the
container's handle: it ignores SIGTERM (the kubelet's TERM is for the container, which as PID 1
gets it only if it handles it), and passes on how the container ended (its exit code, or the
signal that killed it, re-raised on itself). `unshare --fork` would do the same but, in
util-linux 2.38, exits 1 whenever its child is killed by a signal, so an OOM kill read as exit 1.
The parent dies with the stand-in that started it (runtime.PodSpawner), and PID 1 with the parent
(its parent-death signal, set after the change of user, which clears it): PID 1's end takes every
process of the namespace, so no pod outlives the stand-in, as no pod outlives its sandbox.

Usage: python podinit.py SPEC.json  (written by kubelet.py; see Kubelet._run)
"""

import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys

PRIVATE = ("tmp", "home", "root", "run")  # top-level folders that start empty in every container
NEW_ROOT = "/run/.root"
PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up on the node, before the chroot


def mount(*args: str) -> None:
    # A session of its own: the kubelet's TERM goes to the container's process group, and one
    # that comes while the root is still being built (a sidecar told to stop early) would kill
    # this helper and fail the container with exit 1. PID 1 itself is immune to it until it execs.
    subprocess.run(["mount", *args], check=True, stdout=subprocess.DEVNULL, start_new_session=True)


def pass_on(child: int) -> None:
    """The container's parent on the node: ends as its child ended."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):
        if os.WTERMSIG(status) != signal.SIGKILL:  # SIGKILL's disposition cannot be set (nor ignored)
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


def die_with_parent(lifeline: int) -> None:
    """SIGKILL when the parent on the node dies. `lifeline` is the read end of a pipe only the parent
    holds open: readable (at its end) means the parent died before the signal was asked for."""
    if _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        sys.exit(f"podinit: prctl(PR_SET_PDEATHSIG): {os.strerror(ctypes.get_errno())}")
    if select.select([lifeline], [], [], 0)[0]:
        os._exit(137)  # as SIGKILL would have ended it (PID 1 of its namespace cannot SIGKILL itself)
    os.close(lifeline)


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    lifeline, held = os.pipe()
    child = os.fork()
    if child:
        os.close(lifeline)
        pass_on(child)  # `held` stays open until this process ends
    os.close(held)
    mount("-t", "proc", "proc", "/proc")  # the new PID namespace's own
    if spec.get("cgroup"):
        with open(os.path.join(spec["cgroup"], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    # /run is made private first: the new root is built inside it, out of every other pod's sight.
    mount("-t", "tmpfs", "-o", "mode=0755", "tmpfs", "/run")
    root = NEW_ROOT
    os.makedirs(root)
    mount("-t", "tmpfs", "-o", "mode=0755", "tmpfs", root)
    node_folders = []
    for entry in sorted(os.listdir("/")):
        host, mine = f"/{entry}", f"{root}/{entry}"
        if os.path.islink(host):
            os.symlink(os.readlink(host), mine)
        elif not os.path.isdir(host):
            continue
        elif entry == "tmp" and spec.get("tmp"):
            os.makedirs(mine)  # the container's own /tmp, kept on the node (a writable layer's part)
            mount("--bind", spec["tmp"], mine)
        elif entry in PRIVATE:
            os.makedirs(mine)
            mount("-t", "tmpfs", "-o", "mode=1777" if entry == "tmp" else "mode=0755", "tmpfs", mine)
        else:
            os.makedirs(mine)
            mount("--rbind", host, mine)
            if entry not in ("proc", "sys", "dev"):
                node_folders.append(entry)
    mount("-t", "tmpfs", "-o", "mode=1777", "tmpfs", f"{root}/dev/shm")

    def place(target: str) -> str:
        """The target's path in the new root, made if it may be."""
        real = os.path.realpath(target)  # /var/run/x is /run/x
        top = real.strip("/").split("/")[0]
        path = root + real
        if not os.path.exists(path):
            if top in node_folders:
                sys.exit(f"podinit: mount path {target} does not exist in the image and cannot be made in it")
            os.makedirs(path)
        return path

    for path, uid, gid in spec.get("homes", []):
        os.makedirs(root + path, exist_ok=True)
        os.chown(root + path, uid, gid)
    for target in spec.get("tmpfs", []):
        mount("-t", "tmpfs", "-o", "mode=1777", "tmpfs", place(target))
    for source, target, read_only in sorted(spec["binds"], key=lambda b: os.path.realpath(b[1]).count("/")):
        mine = place(target)
        mount("--bind", source, mine)
        if read_only:
            mount("-o", "remount,bind,ro", mine)
    # The image's own files last: where this machine keeps them under /tmp (a checkout there),
    # a volume mounted at /tmp must not hide them, as it never hides a real image's /opt/venv.
    for path in spec.get("image_paths", []):
        mine = place(path)
        mount("--bind", path, mine)
        mount("-o", "remount,bind,ro", mine)
    for entry in node_folders:
        subprocess.run(["mount", "-o", "remount,bind,ro", f"{root}/{entry}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       start_new_session=True)
    if spec.get("hostname"):  # its own UTS namespace (`unshare --uts`): the pod's name, as Kubernetes sets it
        socket.sethostname(spec["hostname"])
    os.chroot(root)
    os.setgroups(spec["groups"])
    os.setgid(spec["gid"])
    os.setuid(spec["uid"])
    die_with_parent(lifeline)  # after the change of user, which clears a parent-death signal
    os.chdir(spec["cwd"])
    os.execvpe(spec["argv"][0], spec["argv"], spec["env"])


if __name__ == "__main__":
    main(sys.argv[1])
