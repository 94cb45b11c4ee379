"""SIGTERM on a worker is an eviction, not a failure (real processes, real signals).

Kubernetes sends SIGTERM to a pod it evicts or preempts, or whose node it drains, and SIGKILL
once the grace period is over. The worker leaves its group at once with exit code
WORKER_LEFT_EXIT_CODE: its rows go back to the queue, the survivors regroup in process, and the
master charges no relaunch against --max-relaunches. In a container the worker is PID 1, to which
the kernel delivers no signal left at its default disposition: the worker installs its own
handler, or it would ignore SIGTERM until the grace period's SIGKILL."""

import http.server
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from elastic_step.audit import audit_report
from elastic_step.protocol import WORKER_LEFT_EXIT_CODE, WorkerEnv

from conftest import SLOW_MODEL

pytestmark = pytest.mark.e2e


def wait_gone(pid: int, timeout: float = 10.0) -> None:
    """Until `pid` is no longer a running process (a zombie counts as gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] in ("Z", "X"):
                    return
        except FileNotFoundError:
            return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} still runs {timeout}s after SIGTERM")


def test_a_sigtermed_worker_leaves_its_rows_return_and_no_relaunch_is_charged(digits, start_job):
    # --max-relaunches 0: a relaunch charged to the slot would leave it exhausted, not relaunched.
    job = start_job("--data", digits, "--workers", "2:3", "--epochs", "2", "--max-relaunches", "0",
                    "--model-def", SLOW_MODEL, "--minibatch-size", "16", "--minibatches-per-task", "2",
                    "--heartbeat-timeout", "4")
    status = job.wait_for(lambda s: s["world_size"] == 3 and 0.1 < s["rows_done"] / s["rows_total"] < 0.5)
    victim = job.kill_worker(status, rank=1, sig=signal.SIGTERM)
    wait_gone(victim["pid"])
    survivors = {w["id"] for w in status["workers"] if w["rank"] is not None and w["id"] != victim["id"]}
    assert job.finish() == 0, job.output()

    report = audit_report(job.audit, digits, 2)
    assert report["exact"], report  # its unapplied rows went back to the queue, none applied twice
    events = job.events()
    left = [e for e in events if e["event"] == "left"]
    assert [e["worker"] for e in left] == [victim["id"]], events
    assert f"exited with code {WORKER_LEFT_EXIT_CODE}" in left[0]["reason"] and "SIGTERM" in left[0]["reason"]
    with open(os.path.join(job.job_dir, "logs", f"{victim['id']}.log")) as f:  # it left through its main thread
        assert f"worker leaves: SIGTERM: leaving the group now (a departure, not a failure) (exit code {WORKER_LEFT_EXIT_CODE})" in f.read()
    assert not [e for e in events if e["event"] in ("died", "dropped", "slot_exhausted", "not_relaunched")], events
    relaunched = [e for e in events if e["event"] == "relaunched"]
    assert [(e["worker"], e["counted"], e["slot_relaunches"]) for e in relaunched] == [(victim["id"], False, 0)]
    # The survivors regrouped in process: the next round keeps them under the same ids (a
    # restarted worker would have a new one), without the one that left.
    after = next(e for e in events if e["event"] == "regrouped" and e["round"] > status["round"])
    assert survivors <= set(after["members"]) and victim["id"] not in after["members"], after
    assert any(e["event"] == "recovered" and e["round"] == after["round"] for e in events), events


class _SilentMaster(http.server.BaseHTTPRequestHandler):
    """A master that takes a worker's registration and never answers it: the worker's main
    thread is then blocked in a network call when SIGTERM comes."""

    called = threading.Event()

    def do_POST(self):
        self.called.set()
        time.sleep(60)

    def log_message(self, *args):
        pass


def test_a_worker_as_pid_1_leaves_on_sigterm(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SilentMaster)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    token = tmp_path / "token"
    token.write_text("t")
    env = dict(os.environ, **{WorkerEnv.MASTER_URL: f"http://127.0.0.1:{server.server_port}",
                              WorkerEnv.TOKEN_FILE: str(token), WorkerEnv.WORKER_ID: "w0.1"})
    # A new PID namespace: the worker is its PID 1, as a container's first process is.
    outer = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-m", "elastic_step.cli", "worker"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert _SilentMaster.called.wait(60), "the worker never called its master"
        worker = _only_child(outer.pid)
        assert _namespace_pid(worker) == 1
        os.kill(worker, signal.SIGTERM)  # from the parent namespace, as the kubelet's runtime does
        assert outer.wait(10) == WORKER_LEFT_EXIT_CODE, outer.stdout.read()
        # The main thread, woken from its blocked call to the master, left through the exit path.
        assert "worker leaves: SIGTERM: leaving the group now" in outer.stdout.read()
    finally:
        if outer.poll() is None:
            outer.kill()
            outer.wait()
        server.shutdown()


def test_pid_1_without_a_handler_ignores_sigterm():
    """Why the worker installs its own handler: the same SIGTERM leaves a PID 1 that kept the
    default disposition running (it still answers afterwards)."""
    program = "import sys\nprint('ready', flush=True)\nprint(sys.stdin.readline().strip(), flush=True)\n"
    outer = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", program],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert outer.stdout.readline().strip() == "ready"
        inner = _only_child(outer.pid)
        assert _namespace_pid(inner) == 1
        os.kill(inner, signal.SIGTERM)  # dropped by the kernel when sent: kill() has returned
        outer.stdin.write("still here\n")
        outer.stdin.flush()
        assert outer.stdout.readline().strip() == "still here"
        assert outer.wait(10) == 0
    finally:
        if outer.poll() is None:
            outer.kill()
            outer.wait()


def _only_child(parent: int, timeout: float = 10.0) -> int:
    """The one child process of `parent` (unshare --fork's), as this PID namespace numbers it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/status") as f:
                        fields = dict(line.split(":", 1) for line in f if ":" in line)
                except OSError:
                    continue
                if int(fields["PPid"]) == parent:
                    children.append(int(entry))
        if len(children) == 1:
            return children[0]
        time.sleep(0.02)
    raise AssertionError(f"process {parent} has no single child")


def _namespace_pid(pid: int) -> int:
    """`pid`'s number in its own (innermost) PID namespace."""
    with open(f"/proc/{pid}/status") as f:
        ns_pids = next(line for line in f if line.startswith("NSpid:")).split()[1:]
    return int(ns_pids[-1])
