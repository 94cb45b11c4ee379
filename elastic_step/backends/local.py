"""Workers as local processes: the embedded default for laptops, the demo and most tests."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Iterator

from elastic_step.backends.api import Backend, LaunchSpec, WorkerExit
from elastic_step.backends.local_forks import ForkServer
from elastic_step.protocol import WORKER_LEFT_EXIT_CODE, WorkerEnv
from elastic_step.terminal import printable


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
            lines = [printable(line.strip()) for line in f.read().decode("utf-8", "replace").splitlines() if line.strip()]
    except OSError:
        return ""
    for line in reversed(lines):
        if line.startswith("elastic-step worker: error:"):
            return f": {line[len('elastic-step worker: error:'):].strip()[:limit]}"
    for line in reversed(lines):
        if line.split(":")[0].endswith(("Error", "Exception", "Interrupt")):
            return f": {line[:limit]}"
    return f": {lines[-1][:limit]}" if lines else ""


MLFLOW_CREDENTIALS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
# Workers are forked from a warm parent that has imported what they import (local_forks.py): a
# replacement's start-up then takes almost no CPU from the survivors on the same cores (a kill
# cost 0.79 s of progress forked, 1.65 s started as a program: benchmarks/README.md). "0": each
# worker is started as a program (`python -m elastic_step.cli worker`).
FORKS_ENV = "ELASTIC_STEP_LOCAL_FORKS"


def forks_wanted() -> bool:
    return os.environ.get(FORKS_ENV, "1") != "0"


def job_environment(job_env: dict[str, str], token_file: str) -> dict[str, str]:
    """What every worker of the job starts with, less its own id and the master's address: also
    what the warm parent imports with (OMP_NUM_THREADS is read as torch loads)."""
    # Workers never call MLflow: the master's MLflow credentials stay with the master.
    env = {k: v for k, v in os.environ.items() if k not in MLFLOW_CREDENTIALS}
    env.update(job_env)
    env.update(
        {
            WorkerEnv.TOKEN_FILE.value: token_file,
            # gloo must talk over loopback: the machine's hostname may resolve elsewhere.
            "GLOO_SOCKET_IFNAME": env.get("GLOO_SOCKET_IFNAME", "lo"),
            # One thread per worker: N workers on a few cores must not oversubscribe them.
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
        }
    )
    return env


def start_warm_parent(python: str, job_dir: str, job_env: dict[str, str], token_file: str) -> ForkServer | None:
    """The job's warm parent; None where it cannot start (workers are then started as programs)."""
    try:
        # torch's device questions through NVML: CUDA stays uninitialised in the parent (local_forks.py).
        env = {**job_environment(job_env, token_file), "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
        return ForkServer(python, env, os.path.join(job_dir, "logs", "forks.log"))
    except OSError:
        return None


@contextlib.contextmanager
def warm_parent_for(config, token_file: str) -> Iterator[ForkServer | None]:
    """A local job's warm parent, started before the master's own start-up (the model check,
    MLflow, a resume's checkpoint) so that its imports (~4 s of CPU) run beside it rather than
    after it. None where workers are not forked. Closed on the way out, whether or not a backend
    took it over. `token_file`: where the master will write the job's token (what its workers get)."""
    parent = None
    if config.backend == "local" and forks_wanted():
        parent = start_warm_parent(sys.executable, config.job_dir, dict(config.worker_env), token_file)
    try:
        yield parent
    finally:
        if parent is not None:
            parent.close()


class LocalBackend(Backend):
    """The master calls launch, stop, poll and describe holding its lock, which its API waits
    on: starting a process (a fork, an exec, its log file opened) happens on this backend's own
    thread, so the lock is never held for it."""

    name = "local"

    def __init__(self, spec: LaunchSpec, python: str = sys.executable, forks: bool | None = None,
                 warm_parent: ForkServer | None = None):
        self.spec = spec
        self.python = python
        self.forks = warm_parent is not None or (forks_wanted() if forks is None else forks)
        # Given (started beside the master's own start-up: warm_parent_for), or started by the
        # launch thread before its first launch; the backend's shutdown closes it.
        self._fork_server: ForkServer | None = warm_parent
        self.procs: dict[str, subprocess.Popen] = {}
        self.log_dir = os.path.join(spec.job_dir, "logs")
        os.makedirs(self.log_dir, exist_ok=True)
        self._lock = threading.Lock()
        self._starting: set[str] = set()  # launched, not yet a process
        self._stopped_early: set[str] = set()  # stopped before its process existed: killed on start
        self._failed: list[WorkerExit] = []  # could not be started at all
        self._launches: queue.Queue = queue.Queue()
        self._launcher = threading.Thread(target=self._launch_loop, name="worker-launches", daemon=True)
        self._launcher.start()

    def launch(self, slot: int, worker_id: str) -> None:
        with self._lock:
            self._starting.add(worker_id)
        self._launches.put(worker_id)

    def _launch_loop(self) -> None:
        if self.forks and self._fork_server is None:
            self._fork_server = start_warm_parent(self.python, self.spec.job_dir, self.spec.env, self.spec.token_file)
        while True:
            worker_id = self._launches.get()
            if worker_id is None:
                return
            try:
                proc = self._start(worker_id)
            except OSError as exc:
                with self._lock:
                    self._starting.discard(worker_id)
                    self._failed.append(WorkerExit(worker_id, f"could not be started: {exc}", None, "count"))
                continue
            with self._lock:
                self._starting.discard(worker_id)
                self.procs[worker_id] = proc
                if worker_id in self._stopped_early:
                    self._stopped_early.discard(worker_id)
                    proc.kill()

    def _start(self, worker_id: str) -> subprocess.Popen:
        env = self._environment(worker_id)
        log_path = os.path.join(self.log_dir, f"{worker_id}.log")
        if self._fork_server is not None:
            try:
                return self._fork_server.start(env, log_path)
            except OSError:  # the server is gone: workers start as programs from now on
                self._fork_server = None
        with open(log_path, "ab") as log:
            return subprocess.Popen(
                [self.python, "-m", "elastic_step.cli", "worker"],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def _environment(self, worker_id: str) -> dict[str, str]:
        env = job_environment(self.spec.env, self.spec.token_file)
        env.update({WorkerEnv.MASTER_URL.value: self.spec.master_url, WorkerEnv.WORKER_ID.value: worker_id})
        return env

    def poll(self) -> list[WorkerExit]:
        with self._lock:
            exits, self._failed = self._failed, []
            for worker_id, proc in list(self.procs.items()):
                code = proc.poll()
                if code is not None:
                    del self.procs[worker_id]
                    if code in (WORKER_LEFT_EXIT_CODE, -signal.SIGTERM):  # through its handler, or before it had one
                        exits.append(WorkerExit(worker_id, f"left on SIGTERM ({describe_returncode(code)})", code, "free", left=True))
                        continue
                    reason = describe_returncode(code)
                    if code > 0:  # it said why before it exited: the last line of its log
                        reason += last_words(os.path.join(self.log_dir, f"{worker_id}.log"))
                    exits.append(WorkerExit(worker_id, reason, code, "count"))
        return exits

    def stop(self, worker_id: str) -> None:
        with self._lock:
            if worker_id in self._starting:
                self._stopped_early.add(worker_id)
                return
            proc = self.procs.get(worker_id)
        if proc is not None and proc.poll() is None:
            proc.kill()  # SIGKILL also ends a SIGSTOPped process

    def shutdown(self, grace_s: float, members: Collection[str] | None = None) -> None:
        self._launches.put(None)  # launches queued before this still start, and are ended or waited for below
        self._launcher.join()
        deadline = time.monotonic() + grace_s
        with self._lock:
            procs = dict(self.procs)
        for worker_id, proc in procs.items():
            if members is not None and worker_id not in members:
                proc.kill()  # nothing of the job's is in it: no reason to wait out its start-up
        for proc in procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        with self._lock:
            self.procs.clear()
        if self._fork_server is not None:
            self._fork_server.close()

    def describe(self, worker_id: str) -> dict:
        with self._lock:
            proc = self.procs.get(worker_id)
        return {"pid": proc.pid} if proc is not None else {}
