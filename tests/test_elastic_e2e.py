"""End to end on digits with real worker processes and real signals: the job survives worker
loss and membership changes, and the audit shows every row of every epoch exactly once. (The
SIGKILL of one of three workers mid-epoch: test_object_stores.py, whose job reads its data from S3.)"""

import glob
import os
import re
import signal
import time

import pytest

from elastic_step.audit import audit_report

from conftest import MODEL, SLOW_MODEL, cli

pytestmark = pytest.mark.e2e

COMMON = ["--minibatch-size", "16", "--minibatches-per-task", "2", "--heartbeat-timeout", "4"]

SLOW = ["--model-def", SLOW_MODEL, *COMMON]


def assert_exact(job, digits, epochs):
    report = audit_report(job.audit, digits, epochs)
    assert report["exact"], report
    assert report["rows_applied"] == report["rows_expected"] == job.result()["rows_audited"]
    return report


def by_round(job, pattern: str) -> dict[int, tuple[str, ...]]:
    """Round -> what `pattern` (its first group the round) caught in the workers' logs."""
    found = {}
    for path in glob.glob(os.path.join(job.job_dir, "logs", "w*.log")):
        for line in open(path):
            m = re.search(pattern, line)
            if m:
                found[int(m.group(1))] = m.groups()[1:]
    return found


def state_transfers(job) -> dict[int, str]:
    """Round -> the ranks the state source sent its state to, as the workers' logs say."""
    return {r: ranks for r, (ranks,) in by_round(job, r"round (\d+): state of rank \d+ sent to ranks (.*) \(\d+ bytes\)").items()}


def mid_epoch(status, world=3):
    return status["world_size"] == world and 0.15 < status["rows_done"] / status["rows_total"] < 0.6


def learning_rates(job) -> dict[int, tuple[str, int]]:
    """Round -> (the learning rate factor its workers applied, rows of its full step), as their logs say."""
    return {r: (factor, int(rows)) for r, (factor, rows) in
            by_round(job, r"round (\d+): learning rate x (\S+) \(linear: (\d+) of 48 rows").items()}


def test_sigkill_the_rank0_worker_while_checkpointing_every_few_steps(digits, start_job):
    # --lr-scaling linear: the survivors' rounds of two train at 2/3 of the full group's rate.
    # --checkpoint-steps 3: rank 0 (the checkpoint's writer) is likely killed mid-checkpoint.
    job = start_job("--data", digits, "--workers", "2:3", "--epochs", "2", "--lr-scaling", "linear", *SLOW,
                    "--checkpoint-steps", "3")
    status = job.wait_for(mid_epoch)
    job.kill_worker(status, rank=0)
    assert job.finish() == 0, job.output()
    assert_exact(job, digits, epochs=2)
    rates = learning_rates(job)
    assert rates[1] == ("1", 48), rates
    assert ("0.6667", 32) in rates.values(), rates
    assert set(rates.values()) <= {("1", 48), ("0.6667", 32)}, rates
    # Every committed checkpoint is whole: its ledger and state load.
    from elastic_step.tracking.checkpoints import read_local

    folder = os.path.join(job.job_dir, "checkpoints")
    names = [name for name in os.listdir(folder) if name.startswith("step-")]
    assert names, os.listdir(folder)
    for name in names:
        checkpoint = read_local(os.path.join(folder, name))
        assert checkpoint.step == int(name[5:]) and checkpoint.state and "epochs" in checkpoint.ledger


def test_scale_out_from_two_to_three_the_joiner_gets_state_and_contributes(digits, start_job):
    from conftest import cli

    job = start_job("--data", digits, "--workers", "2:3", "--epochs", "12", *SLOW)
    # `train` starts MAX workers; scale to 2 first, then grow back to 3 with a fresh joiner.
    job.wait_for(lambda s: s["world_size"] == 3)
    assert cli("scale", "--job-dir", job.job_dir, "--workers", "2").returncode == 0
    job.wait_for(lambda s: s["world_size"] == 2 and s["round_ready"])
    done = cli("scale", "--job-dir", job.job_dir, "--workers", "3")
    assert done.returncode == 0, done.stderr
    status = job.wait_for(lambda s: s["world_size"] == 3 and any(w["id"] == "w2.2" and w["rows_applied"] > 0 for w in s["workers"]))
    assert status["state"] == "running"
    assert job.finish() == 0, job.output()
    assert_exact(job, digits, epochs=12)
    regrouped = [e for e in job.events() if e["event"] == "regrouped"]
    assert [e["world_size"] for e in regrouped][-2:] == [2, 3]
    assert regrouped[-1]["source"] != "w2.2"  # the joiner took the survivors' state


def test_scale_in_from_three_to_two(digits, start_job):
    from conftest import cli

    job = start_job("--data", digits, "--workers", "2:3", "--epochs", "2", *SLOW)
    job.wait_for(lambda s: s["world_size"] == 3 and s["rows_done"] > 0)
    assert cli("scale", "--job-dir", job.job_dir, "--workers", "2").returncode == 0
    status = job.wait_for(lambda s: s["world_size"] == 2 and s["round_ready"])
    assert sorted(w["slot"] for w in status["workers"] if w["rank"] is not None) == [0, 1]
    assert job.finish() == 0, job.output()
    assert_exact(job, digits, epochs=2)
    # the highest slot retires (it leaves on its own, or at the job's end on a slow machine)
    retired = [e for e in job.events() if e["event"] == "round_proposed" and "retires" in e["cause"]]
    assert retired and retired[0]["cause"].startswith("scaled in: w2.")
    assert all(e["worker"].startswith("w2.") for e in job.events() if e["event"] == "left")
    assert not [e for e in job.events() if e["event"] in ("died", "relaunched")]


def test_sigstop_worker_is_dropped_after_the_heartbeat_timeout(digits, start_job):
    job = start_job("--data", digits, "--workers", "2:3", "--epochs", "4", *SLOW)
    status = job.wait_for(mid_epoch)
    stopped_at = time.time()
    victim = job.kill_worker(status, rank=2, sig=signal.SIGSTOP)
    assert job.finish() == 0, job.output()
    assert_exact(job, digits, epochs=4)
    dropped = [e for e in job.events() if e["event"] == "dropped"]
    assert dropped and dropped[0]["worker"] == victim["id"] and "hung" in dropped[0]["message"]
    assert dropped[0]["time"] - stopped_at >= 3.5


def test_data_that_does_not_divide_evenly(digits, start_job):
    # 1437 training rows in 256-row shards, minibatches of 7 in tasks of 3: ragged everywhere.
    job = start_job("--data", digits, "--workers", "3", "--epochs", "2", "--model-def", MODEL,
                    "--minibatch-size", "7", "--minibatches-per-task", "3")
    assert job.finish() == 0, job.output()
    assert_exact(job, digits, epochs=2)
