"""Shared fixtures: prepared digits data (made once per session) and a runner for real
`elastic-step train` jobs whose workers are real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from elastic_step.operate.client import try_status

MODEL = "elastic_step.model_zoo.digits_torch"
# The same model, 20 ms slower per step: for tests that must act while a job runs.
SLOW_MODEL = os.path.join(os.path.dirname(__file__), "model_defs", "slow_digits.py")


@pytest.fixture(scope="session")
def digits(tmp_path_factory) -> str:
    from elastic_step.data.prepare import prepare_data

    out = str(tmp_path_factory.mktemp("digits"))
    prepare_data("sklearn:digits", out, rows_per_shard=256, seed=0)
    return out


def cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "elastic_step.cli", *args], capture_output=True, text=True, **kwargs)


def synthetic_clicks(out, rows: int, seed: int, rows_per_shard: int) -> str:
    """`prepare-data` of the synthetic Criteo-shaped click log into `out`, its strings made ids
    (`--categorical auto`): the data of the parameter-server tests."""
    done = cli("prepare-data", "--source", f"synthetic:criteo?rows={rows}&seed={seed}", "--out", str(out),
               "--categorical", "auto", "--rows-per-shard", str(rows_per_shard))
    assert done.returncode == 0, done.stderr
    return str(out)


class Job:
    """An `elastic-step train` process and what it leaves in its job dir."""

    def __init__(self, job_dir: str, args: list[str]):
        self.job_dir = job_dir
        self.audit = os.path.join(job_dir, "audit.jsonl")
        os.makedirs(job_dir, exist_ok=True)
        self.log = open(os.path.join(job_dir, "train.out"), "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "elastic_step.cli", "train", "--job-dir", job_dir, "--audit", self.audit,
             "--no-progress", *args],
            stdout=self.log, stderr=subprocess.STDOUT,
        )

    def status(self) -> dict | None:
        # In process (a CLI process per poll is too slow to catch a job mid-epoch);
        # test_cli covers `elastic-step status` itself.
        return try_status(self.job_dir)

    def wait_for(self, predicate, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"job ended (code {self.proc.returncode}) before the condition:\n{self.output()}")
            s = self.status()
            if s is not None and predicate(s):
                return s
            time.sleep(0.05)
        raise AssertionError(f"condition not reached in {timeout}s; last status {s}\n{self.output()}")

    def kill_worker(self, status: dict, rank: int, sig=signal.SIGKILL) -> dict:
        worker = next(w for w in status["workers"] if w["rank"] == rank and w["state"] == "live")
        os.kill(worker["pid"], sig)
        return worker

    def finish(self, timeout: float = 300.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def result(self) -> dict:
        with open(os.path.join(self.job_dir, "result.json")) as f:
            return json.load(f)

    def events(self) -> list[dict]:
        with open(os.path.join(self.job_dir, "events.jsonl")) as f:
            return [json.loads(line) for line in f]


@pytest.fixture
def start_job(tmp_path):
    jobs: list[Job] = []

    def start(*args: str, name: str = "job") -> Job:
        job = Job(str(tmp_path / name), list(args))
        jobs.append(job)
        return job

    yield start
    for job in jobs:  # nothing left running, whatever the test did
        if job.proc.poll() is None:
            job.proc.send_signal(signal.SIGTERM)
            try:
                job.proc.wait(15)
            except subprocess.TimeoutExpired:
                job.proc.kill()
        job.log.close()


def worker_processes(job_dir: str) -> list[int]:
    """PIDs of live processes started as workers of this job (found by their environment)."""
    marker = f"ELASTIC_STEP_TOKEN_FILE={os.path.join(job_dir, 'token')}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    with open(f"/proc/{entry}/stat") as s:
                        if s.read().split(")")[-1].split()[0] != "Z":
                            pids.append(int(entry))
        except OSError:
            continue
    return pids


def kill_master(job) -> None:
    """SIGKILL a job's master; its workers notice it is gone and leave by themselves."""
    job.proc.send_signal(signal.SIGKILL)
    job.proc.wait()
    deadline = time.monotonic() + 60
    while worker_processes(job.job_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not worker_processes(job.job_dir), "workers outlived their master"


def resume_exactly(start_job, args, data: str, epochs: int):
    """Run the same job again with --resume; it must resume once, finish, and leave an exact audit.
    Returns the job and the step it resumed from."""
    from elastic_step.audit import audit_report

    second = start_job(*args, "--resume", name="job")
    assert second.finish() == 0, second.output()
    assert "resuming run" in second.output()
    lines = [json.loads(line) for line in open(second.audit)]
    resume = [line["resume_from_step"] for line in lines if "resume_from_step" in line]
    assert len(resume) == 1 and resume[0] > 0
    report = audit_report(second.audit, data, epochs=epochs)
    assert report["exact"], report
    return second, resume[0]


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    from mlflow_server import MlflowServer

    server = MlflowServer(str(tmp_path_factory.mktemp("mlflow")))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, digits, mlflow_server):
    """One finished job on the digits model (2 workers, 2 epochs, a checkpoint every 20 steps)
    recorded on `mlflow_server` in the experiment "recorded": what a run records, and the champion
    that warm-start tests start from. Made once: each job costs seconds of process start-up."""
    job = Job(str(tmp_path_factory.mktemp("trained") / "job"),
              ["--data", digits, "--workers", "2", "--epochs", "2", "--model-def", MODEL, "--minibatch-size", "16",
               "--minibatches-per-task", "2", "--mlflow-uri", mlflow_server.uri, "--experiment", "recorded",
               "--checkpoint-steps", "20"])
    assert job.finish() == 0, job.output()
    return job


@pytest.fixture
def closing():
    """closing(thing) is `thing`, closed at the test's end (the last first), whether the test
    passed or not: a ShardState (its ledger's file and fsync thread), a ledger, a client."""
    things = []

    def close_later(thing):
        things.append(thing)
        return thing

    yield close_later
    for thing in reversed(things):
        thing.close()


@pytest.fixture
def ledgers_closed():
    """Fails a test that leaves a shard's ledger (ps/ledger.py: every recovered ShardState has
    one) open: its file descriptor, and once a push was synced its fsync thread ("ledger-fsync"),
    would stay for the rest of the session. A test closes what it opens (ShardState.close) in a
    `finally` or a fixture's teardown, so a failing one leaves none either. What is left is
    closed here before the test is failed. The modules that make ledgers use it (pytestmark)."""
    from elastic_step.ps.ledger import Ledger

    made, closed, init, close = [], set(), Ledger.__init__, Ledger.close

    def tracked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    def closing(self):
        closed.add(id(self))
        close(self)

    before = {t for t in threading.enumerate() if t.name == "ledger-fsync"}
    with pytest.MonkeyPatch.context() as patched:  # its own: a test's monkeypatch.undo() leaves it
        patched.setattr(Ledger, "__init__", tracked)
        patched.setattr(Ledger, "close", closing)
        yield
    # Never closed, its file closed or not (a failed rotation closes only the file: the thread stays).
    left = [ledger.path for ledger in made if id(ledger) not in closed]
    for ledger in made:
        if id(ledger) not in closed:
            ledger.close()
    threads = [t for t in threading.enumerate() if t.name == "ledger-fsync" and t not in before]
    for thread in threads:
        thread.join(5)
    alive = [t for t in threads if t.is_alive()]
    assert not left and not alive, f"the test left {len(left)} ledger(s) open ({left}), {len(alive)} ledger-fsync thread(s) alive"
