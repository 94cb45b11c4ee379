"""Workers as local processes: the embedded default for laptops, the demo and most tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from elastic_step.backends.api import Backend, LaunchSpec, WorkerExit


def describe_returncode(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def last_words(log_path: str, limit: int = 300) -> str:
    """': <why a worker exited>' from the end of its log: its own one-line error, else the last
    line of a traceback, else its last line ('' when it wrote nothing)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(log_path) - 8192))
            lines = [line.strip() for line in f.read().decode("utf-8", "replace").splitlines() if line.strip()]
    except OSError:
        return ""
    for line in reversed(lines):
        if line.startswith("elastic-step worker: error:"):
            return f": {line[len('elastic-step worker: error:'):].strip()[:limit]}"
    for line in reversed(lines):
        if line.split(":")[0].endswith(("Error", "Exception", "Interrupt")):
            return f": {line[:limit]}"
    return f": {lines[-1][:limit]}" if lines else ""


class LocalBackend(Backend):
    name = "local"

    def __init__(self, spec: LaunchSpec, python: str = sys.executable):
        self.spec = spec
        self.python = python
        self.procs: dict[str, subprocess.Popen] = {}
        self.log_dir = os.path.join(spec.job_dir, "logs")
        os.makedirs(self.log_dir, exist_ok=True)

    def launch(self, slot: int, worker_id: str) -> None:
        env = dict(os.environ)
        env.update(self.spec.env)
        env.update(
            {
                "ELASTIC_STEP_MASTER_URL": self.spec.master_url,
                "ELASTIC_STEP_TOKEN_FILE": self.spec.token_file,
                "ELASTIC_STEP_WORKER_ID": worker_id,
                # gloo must talk over loopback: the machine's hostname may resolve elsewhere.
                "GLOO_SOCKET_IFNAME": env.get("GLOO_SOCKET_IFNAME", "lo"),
                # One thread per worker: N workers on a few cores must not oversubscribe them.
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
            }
        )
        log = open(os.path.join(self.log_dir, f"{worker_id}.log"), "ab")
        self.procs[worker_id] = subprocess.Popen(
            [self.python, "-m", "elastic_step.cli", "worker"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()

    def poll(self) -> list[WorkerExit]:
        exits = []
        for worker_id, proc in list(self.procs.items()):
            code = proc.poll()
            if code is not None:
                del self.procs[worker_id]
                reason = describe_returncode(code)
                if code > 0:  # it said why before it exited: the last line of its log
                    reason += last_words(os.path.join(self.log_dir, f"{worker_id}.log"))
                exits.append(WorkerExit(worker_id, reason, code, "count"))
        return exits

    def stop(self, worker_id: str) -> None:
        proc = self.procs.get(worker_id)
        if proc is not None and proc.poll() is None:
            proc.kill()  # SIGKILL also ends a SIGSTOPped process

    def shutdown(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for proc in list(self.procs.values()):
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()

    def describe(self, worker_id: str) -> dict:
        proc = self.procs.get(worker_id)
        return {"pid": proc.pid} if proc is not None else {}
