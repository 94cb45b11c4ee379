"""A pod of the cluster stand-in's process runtime dies with the stand-in that started it, as a
kubelet's pods go with their sandbox: a cluster test that fails or is killed (a timeout's kill -9,
where no fixture's teardown runs) leaves no pod's processes behind — no podinit, no container, no
process the container started (a master's shard pods, `ps_pods --shard`, are such pods).

The stand-in here is a process of its own that starts one pod as the kubelet does, from a thread
that ends once the container runs (the kernel's parent-death signal is tied to the thread that
forked: the pod must outlive that thread, and die with the process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from cluster.runtime import can_isolate

TESTS = os.path.dirname(os.path.abspath(__file__))

STAND_IN = r'''
import sys, threading, time
from cluster.runtime import ProcessRuntime, venv_image

runtime, image = ProcessRuntime(isolate=True), venv_image("process-image")
# the container's first process starts one of its own, as a master starts its workers
argv = ["python", "-c", "import subprocess, time; subprocess.Popen(['sleep', '120']); time.sleep(120)"]
started = []
start = threading.Thread(target=lambda: started.append(runtime.run(
    sys.argv[1], "pod-death", image, argv, image.env, [], [], image.uid, image.gid, [image.gid], image.workdir, None)))
start.start()
start.join()
print(started[0].proc.pid, flush=True)
time.sleep(120)
'''


def descendants(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        return []
    return [p for c in children for p in (c, *descendants(c))]


def live(pid: int, start: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return False
    return fields[0] != "Z" and fields[19] == start  # the same process (its start time), not dead


def start_time(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[19]


def test_a_pods_processes_die_with_the_stand_in_that_started_them(tmp_path):
    if not can_isolate():
        pytest.fail("this node cannot make namespaces (needs root and unshare)")
    stand_in = subprocess.Popen([sys.executable, "-c", STAND_IN, str(tmp_path / "container")], stdout=subprocess.PIPE,
                                text=True, cwd=TESTS, env={**os.environ, "PYTHONPATH": TESTS}, start_new_session=True)
    pod: dict[int, str] = {}
    try:
        podinit = int(stand_in.stdout.readline())
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # podinit -> the container's PID 1 -> its sleep
            tree = [podinit, *descendants(podinit)]
            if len(tree) >= 3 and any(open(f"/proc/{p}/comm").read().strip() == "sleep" for p in tree[1:]
                                      if os.path.exists(f"/proc/{p}/comm")):
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"the pod did not start its processes (its log: {(tmp_path / 'container' / 'log').read_text()})")
        pod = {p: start_time(p) for p in tree}
        time.sleep(0.3)
        assert all(live(p, s) for p, s in pod.items()), "the pod died with the thread that started it"

        stand_in.kill()
        stand_in.wait(10)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(live(p, s) for p, s in pod.items()):
            time.sleep(0.05)
        left = [p for p, s in pod.items() if live(p, s)]
        assert not left, f"processes of the pod outlived the stand-in: {left}"
    finally:
        if stand_in.poll() is None:
            stand_in.kill()
            stand_in.wait()
        for pid, start in pod.items():  # what a failure left, ours by pid and start time
            if live(pid, start):
                os.kill(pid, signal.SIGKILL)
