"""A warm parent for local workers: one process per job imports what a worker imports (torch,
the worker's modules, what torch's first optimizer imports) once, then forks each worker from
itself. A worker started by `python -m elastic_step.cli worker` spends about 4 s of CPU on
imports before its first step; on a node whose cores the survivors of a kill keep busy, that CPU
is taken from them, and each kill costs the group about that much progress. A forked worker
starts with all of it done.

Like a DataLoader's workers, the children are forked after `import torch` and before any torch
work (no thread pool, no process group yet). CUDA does not survive a fork: a child of a parent
that initialised it cannot use the GPU. So the server asks torch's device questions through NVML
(PYTORCH_NVML_BASED_CUDA_CHECK, which initialises nothing), and if an import initialised CUDA all
the same it forks nothing and ends: the backend then starts its workers as programs. The server
reaps its children and reports each exit, as the kernel's wait status says it, to the backend:
its children are not the master's.
The pipe protocol is one JSON object a line; requests: {"env": {...}, "log": path}; replies:
{"pid": N} for each request in order, {"pid": N, "code": C} when a child ends.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import traceback

# What a torch worker imports before its first step: the worker's modules, the data reader's
# (pyarrow, pandas, fsspec) and what torch's first optimizer imports (torch._dynamo). A module
# this environment lacks is skipped: its workers import what they need themselves.
PRELOAD = ("elastic_step.cli", "elastic_step.worker.loop", "elastic_step.worker.preflight", "pyarrow.parquet", "pyarrow.compute",
           "pandas", "fsspec.implementations.local", "torch._dynamo")


class ForkedProcess:
    """The backend's handle on a forked worker: Popen's pid, poll, kill and wait."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self._ended = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:  # ended; its exit is on its way from the server
                pass

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
        return self.returncode

    def ended(self, code: int) -> None:
        self.returncode = code
        self._ended.set()


class ForkServer:
    """The master's side: starts the server, asks it for workers, hears their exits."""

    def __init__(self, python: str, env: dict[str, str], log_path: str):
        # The server opens its log when it forks its first worker: a job that fails before any
        # worker starts leaves no log of one (its logs folder is where people look for workers).
        self.proc = subprocess.Popen([python, "-m", "elastic_step.backends.local_forks", log_path], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self._children: dict[int, ForkedProcess] = {}
        self._started: list[ForkedProcess | None] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read_replies, name="worker-forks", daemon=True)
        self._reader.start()

    def start(self, env: dict[str, str], log_path: str) -> ForkedProcess:
        """A worker forked with `env`, writing to `log_path`; OSError when the server is gone."""
        try:
            self.proc.stdin.write(json.dumps({"env": env, "log": log_path}).encode() + b"\n")
            self.proc.stdin.flush()
        except (OSError, ValueError) as exc:
            raise OSError(f"the workers' fork server is gone ({exc})") from None
        with self._cond:
            self._cond.wait_for(lambda: self._started)
            child = self._started.pop(0)
        if child is None:
            raise OSError(f"the workers' fork server is gone ({self.proc.poll()})")
        return child

    def _read_replies(self) -> None:
        try:
            for line in self.proc.stdout:
                reply = json.loads(line)
                with self._cond:
                    if "code" in reply:
                        self._children.pop(reply["pid"]).ended(reply["code"])
                        continue
                    child = self._children[reply["pid"]] = ForkedProcess(reply["pid"])
                    self._started.append(child)
                    self._cond.notify_all()
        except (ValueError, KeyError, TypeError):  # not the server's protocol: no server to trust
            self.proc.kill()
        # The server is gone: its children's exits can no longer be told, so they end now.
        with self._cond:
            self._started.append(None)
            self._cond.notify_all()
            orphans, self._children = list(self._children.values()), {}
        for child in orphans:
            child.kill()
            child.ended(-signal.SIGKILL)

    def close(self) -> None:
        """The server ends: when its requests end, or at once when no child of its runs (it holds
        nothing else, and may still be importing: a job that failed before its first launch).
        Children still running run on."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        with self._cond:
            idle = not self._children
        if idle:
            self.proc.kill()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(10)


# -- the server's side ---------------------------------------------------------------------------
def preload() -> list[str]:
    """Imports what a worker imports; a line for each module that could not be."""
    notes = []
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as exc:  # an optional framework: the worker imports its own
            notes.append(f"fork server: not preloaded: {name}: {type(exc).__name__}: {exc}")
    return notes


def open_log(log_path: str, notes: list[str]) -> None:
    """From now on stdout and stderr (print(), a traceback) go to the log, which starts with `notes`."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    os.dup2(log, 1), os.dup2(log, 2)
    os.close(log)
    for note in notes:
        print(note, file=sys.stderr, flush=True)


def become_worker(request: dict, server_fds: list[int]) -> None:
    """In the child: the worker process, as `python -m elastic_step.cli worker` would run it."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in server_fds:
            os.close(fd)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
        null = os.open(os.devnull, os.O_RDONLY)
        for source, target in ((null, 0), (log, 1), (log, 2)):
            os.dup2(source, target)
        os.close(log), os.close(null)
        os.environ.clear()
        os.environ.update(request["env"])
        if "numpy" in sys.modules:  # a fresh process's global RNG, not the server's copy
            sys.modules["numpy"].random.seed()
        sys.argv = [sys.argv[0], "worker"]
        from elastic_step.cli import main

        code = main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)


def serve(log_path: str) -> None:
    # Replies go out on a copy of stdout; print() goes to the log once there is one (open_log).
    requests, replies = os.dup(0), os.dup(1)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    notes = preload()
    if cuda_initialised():
        notes.append("fork server: importing the workers' modules initialised CUDA, which a forked worker could not "
                     "use: workers start as programs")
        open_log(log_path, notes)
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)  # the backend hears the server is gone at its first request
    log_open = False
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)  # a SIGCHLD wakes the select below
    signal.signal(signal.SIGCHLD, lambda *_: None)
    pending = b""
    while True:
        readable, _, _ = select.select([requests, wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
        reap(replies)
        if requests not in readable:
            continue
        data = os.read(requests, 1 << 16)
        if not data:  # the master is gone or done
            # At once: the interpreter's own teardown (torch, pandas, pyarrow) took seconds, and
            # a preempted master waits for this process within its grace period.
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(0)
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            if not log_open:
                open_log(log_path, notes)
                log_open = True
            sys.stdout.flush(), sys.stderr.flush()  # nothing buffered is written twice
            pid = os.fork()
            if pid == 0:
                become_worker(json.loads(line), [requests, replies, wake_r, wake_w])
            os.write(replies, json.dumps({"pid": pid}).encode() + b"\n")


def cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def reap(replies: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        os.write(replies, json.dumps({"pid": pid, "code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


if __name__ == "__main__":
    serve(sys.argv[1])
