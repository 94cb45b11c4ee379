"""Workers forked from a warm parent (ELASTIC_STEP_LOCAL_FORKS=1, backends/local_forks.py): each is
the worker program with its own environment and log, its exit is reported as a started
program's would be, a stop kills it, and the parent ends with the backend. Real processes;
tests/test_spares.py runs a whole job, kills and relaunches included, on forked workers."""

from __future__ import annotations

import os
import time

from test_kubernetes_backend import exits_until
from test_local_backend import backend_for


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_a_forked_worker_runs_the_worker_program_with_its_own_environment_and_its_exit_or_kill_is_reported(tmp_path):
    backend = backend_for(tmp_path, forks=True)
    backend.launch(0, "w0.1")
    backend.launch(1, "w1.1")
    deadline = time.monotonic() + 180  # the parent imports torch first: many seconds on a busy machine
    while not all("pid" in backend.describe(w) for w in ("w0.1", "w1.1")) and time.monotonic() < deadline:
        time.sleep(0.05)
    server = backend._fork_server.proc
    assert all(parent_of(backend.describe(w)["pid"]) == server.pid for w in ("w0.1", "w1.1"))  # forked, not started
    backend.stop("w1.1")
    exits = exits_until(backend, 2, timeout=120)
    assert exits["w1.1"].reason == "killed by SIGKILL", exits
    # w0.1 found no master (the address refuses) and said so, in its own log, as a started worker does.
    assert exits["w0.1"].returncode and exits["w0.1"].returncode > 0 and exits["w0.1"].relaunch == "count", exits
    log = open(os.path.join(tmp_path, "logs", "w0.1.log")).read()
    assert "master at http://127.0.0.1:9 refuses connections" in log, log
    assert exits["w0.1"].reason.startswith(f"exited with code {exits['w0.1'].returncode}: ") and "127.0.0.1:9" in exits["w0.1"].reason, exits
    backend.shutdown(grace_s=0)
    assert server.poll() is not None  # the parent ends with the backend


def test_a_warm_parent_whose_imports_initialised_cuda_forks_nothing_and_workers_start_as_programs(tmp_path):
    # CUDA does not survive a fork. No GPU here: the parent is told CUDA is initialised (as an
    # import on a GPU machine could leave it) by a sitecustomize module on its path.
    from elastic_step.backends.api import LaunchSpec
    from elastic_step.backends.local import LocalBackend

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import torch\ntorch.cuda.is_initialized = lambda: True\n")
    token = tmp_path / "token"
    token.write_text("t")
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    backend = LocalBackend(LaunchSpec("http://127.0.0.1:9", str(token), str(tmp_path), env={"PYTHONPATH": path}), forks=True)
    try:
        backend.launch(0, "w0.1")
        deadline = time.monotonic() + 180
        while "pid" not in backend.describe("w0.1") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert parent_of(backend.describe("w0.1")["pid"]) == os.getpid()  # started as a program, not forked
        assert backend._fork_server is None
        log = open(os.path.join(tmp_path, "logs", "forks.log")).read()
        assert "initialised CUDA, which a forked worker could not use: workers start as programs" in log, log
    finally:
        backend.shutdown(grace_s=0)
