"""SIGTERM to the master is a preemption, with real jobs and real signals: the master checkpoints
its next step, marks its MLflow run preempted and exits 75 within its grace period; the SAME
command run again (no --resume) continues the run from that checkpoint and the audit shows every
row of every epoch applied exactly once. A master that cannot checkpoint still exits 75 at once
and says so in one line."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from mlflow.tracking import MlflowClient

from elastic_step.audit import audit_report
from elastic_step.exit_codes import ExitCode

from conftest import SLOW_MODEL, worker_processes

pytestmark = pytest.mark.e2e

FAST = ["--minibatch-size", "16", "--minibatches-per-task", "2"]
GRACE_S = 20


def sigterm_master(job) -> float:
    """SIGTERM to the master alone (as the kubelet sends it to the container's PID 1); the seconds
    until it exited."""
    job.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    job.proc.wait(GRACE_S + 30)
    return time.monotonic() - sent


def mlflow_run(job_dir: str, run_id: str):
    return MlflowClient(f"sqlite:///{os.path.join(job_dir, 'mlflow.db')}").get_run(run_id)


def resume_markers(audit: str) -> list[int]:
    with open(audit) as f:
        return [json.loads(line)["resume_from_step"] for line in f if "resume_from_step" in line]


def test_a_master_sigtermed_mid_epoch_checkpoints_exits_75_and_the_same_command_resumes_exactly(digits, start_job):
    args = ["--data", digits, "--workers", "2", "--epochs", "2", "--model-def", SLOW_MODEL, *FAST,
            "--checkpoint-steps", "1000", "--termination-grace", str(GRACE_S)]  # no checkpoint but the preemption's
    first = start_job(*args)
    before = first.wait_for(lambda s: s["epoch"] == 0 and s["rows_done"] > 0.15 * s["rows_total"], timeout=300)
    took = sigterm_master(first)

    assert first.proc.returncode == ExitCode.PREEMPTED, first.output()
    assert took < GRACE_S, f"the preempted master took {took:.1f}s, past its {GRACE_S}s grace period"
    assert not worker_processes(first.job_dir), "workers outlived their preempted master"
    result = first.result()
    assert result["state"] == "preempted" and result["checkpoint_step"] is not None, result
    assert result["checkpoint_step"] > before["step"]  # a checkpoint taken for the SIGTERM, not an older one
    message = [line for line in first.output().splitlines() if line.startswith("elastic-step train:")]
    assert len(message) == 1 and "preempted (SIGTERM)" in message[0] and "error" not in message[0], message
    run = mlflow_run(first.job_dir, result["run_id"])
    assert run.info.status == "KILLED" and run.data.tags["elastic_step.state"] == "preempted"
    assert run.data.tags["elastic_step.checkpoint"] == str(result["checkpoint_step"])
    client = MlflowClient(f"sqlite:///{os.path.join(first.job_dir, 'mlflow.db')}")
    assert not client.list_artifacts(result["run_id"], "plots")  # the grace went to the checkpoint, not to plotting

    second = start_job(*args)  # the same command, as a retry runs it: no --resume
    assert second.finish() == 0, second.output()
    assert f"resuming run {result['run_id']} from its checkpoint of step {result['checkpoint_step']}" in second.output()
    assert resume_markers(second.audit) == [result["checkpoint_step"]]
    report = audit_report(second.audit, digits, epochs=2)
    assert report["exact"], report  # every row of every epoch exactly once, none doubled
    run = mlflow_run(second.job_dir, result["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["elastic_step.state"] == "succeeded"
    assert client.list_artifacts(result["run_id"], "plots")  # the run's end plots the whole run


def test_a_master_that_cannot_checkpoint_still_exits_75_at_once_saying_so_and_the_retry_starts_over(digits, start_job):
    args = ["--data", digits, "--workers", "2", "--epochs", "1", "--model-def", SLOW_MODEL, *FAST,
            "--checkpoint-steps", "0", "--termination-grace", str(GRACE_S)]
    first = start_job(*args)
    first.wait_for(lambda s: s["rows_done"] > 0.2 * s["rows_total"], timeout=300)
    took = sigterm_master(first)

    assert first.proc.returncode == ExitCode.PREEMPTED, first.output()
    assert took < GRACE_S / 2, f"nothing to checkpoint, yet the master took {took:.1f}s"
    message = [line for line in first.output().splitlines() if line.startswith("elastic-step train:")]
    assert len(message) == 1 and "no checkpoint on SIGTERM" in message[0] and "--checkpoint-steps 0" in message[0], message
    assert first.result()["state"] == "preempted" and first.result()["checkpoint_step"] is None

    second = start_job(*args)
    assert second.finish() == 0, second.output()
    assert "starting from the beginning" in second.output()
    assert resume_markers(second.audit) == [0]  # the first attempt's rows are void, and the audit says so
    report = audit_report(second.audit, digits, epochs=1)
    assert report["exact"], report
