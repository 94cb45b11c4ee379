"""The local backend starts worker processes on a thread of its own: the master's calls (made
under its lock) return at once, whatever a start costs; a worker stopped before its process
exists is killed as it starts; a process that cannot be started comes back as an exit."""

from __future__ import annotations

import time

from elastic_step.backends.api import LaunchSpec
from elastic_step.backends.local import LocalBackend
from test_kubernetes_backend import exits_until


def backend_for(tmp_path, **options) -> LocalBackend:
    options.setdefault("forks", False)  # workers started as programs; test_local_forks.py forks them
    token = tmp_path / "token"
    token.write_text("t")
    # The master's address refuses connections: these workers only need to be processes.
    return LocalBackend(LaunchSpec("http://127.0.0.1:9", str(token), str(tmp_path)), **options)


def test_a_slow_start_never_holds_up_the_caller_and_a_worker_stopped_before_it_started_is_killed(tmp_path, monkeypatch):
    backend = backend_for(tmp_path)
    real_start = backend._start

    def slow_start(worker_id):
        time.sleep(0.5)  # a fork of a large master on a busy node
        return real_start(worker_id)

    monkeypatch.setattr(backend, "_start", slow_start)
    started = time.monotonic()
    backend.launch(0, "w0.1")
    backend.launch(1, "w1.1")
    backend.stop("w1.1")  # before its process exists
    assert time.monotonic() - started < 0.1
    assert backend.describe("w0.1") == {}  # not started yet
    deadline = time.monotonic() + 10
    while "pid" not in backend.describe("w0.1") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert backend.describe("w0.1")["pid"] > 0
    exits = exits_until(backend, 2)
    assert exits["w1.1"].reason == "killed by SIGKILL", exits
    assert exits["w0.1"].returncode and exits["w0.1"].returncode > 0  # it found no master, and said so
    backend.shutdown(grace_s=0)


def test_a_process_that_cannot_be_started_is_an_exit(tmp_path):
    backend = backend_for(tmp_path, python=str(tmp_path / "no-such-python"))
    backend.launch(0, "w0.1")
    exits = exits_until(backend, 1)
    assert "could not be started" in exits["w0.1"].reason and exits["w0.1"].relaunch == "count", exits
    backend.shutdown(grace_s=0)


def test_at_shutdown_the_last_rounds_workers_may_finish_and_a_worker_still_starting_is_ended_at_once(tmp_path):
    # A stand-in for Python: the round's member finishes in 0.5 s; the other (a relaunch still
    # importing torch when the job ended) would take a minute to notice anything.
    python = tmp_path / "python"
    python.write_text('#!/bin/sh\nif [ "$ELASTIC_STEP_WORKER_ID" = w0.1 ]; then sleep 0.5; exit 0; fi\nsleep 60\n')
    python.chmod(0o755)
    backend = backend_for(tmp_path, python=str(python))
    backend.launch(0, "w0.1")
    backend.launch(1, "w1.2")
    deadline = time.monotonic() + 10
    while len(backend.procs) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    member, starting = backend.procs["w0.1"], backend.procs["w1.2"]
    began = time.monotonic()
    backend.shutdown(grace_s=10, members=["w0.1"])
    assert time.monotonic() - began < 5  # not the 10 s grace, and not the joiner's minute
    assert member.returncode == 0  # given its time to leave on its own
    assert starting.returncode == -9  # ended at once
