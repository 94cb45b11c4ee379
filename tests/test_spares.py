"""Warm spares (`--spares K`): extra workers that start, warm up and wait; a lost member's rank
goes to a spare in the next round, with no relaunch to wait for. Real processes, real signals; the
workers are forked from a warm parent (ELASTIC_STEP_LOCAL_FORKS=1), as a replacement's start-up
then takes little CPU: this is also the end-to-end test of forked workers killed and relaunched."""

import os
import re
import signal

import pytest

from elastic_step.audit import audit_report

from conftest import SLOW_MODEL, cli

pytestmark = pytest.mark.e2e

FIXED = ["--model-def", SLOW_MODEL, "--workers", "3", "--spares", "1", "--minibatch-size", "16",
         "--minibatches-per-task", "2", "--heartbeat-timeout", "4"]


def spares(status) -> list[dict]:
    return [w for w in status["workers"] if w["spare"]]


def full_with_a_spare(status) -> bool:
    return status["world_size"] == 3 and len(spares(status)) == 1 and 0.1 < status["rows_done"] / status["rows_total"] < 0.5


def test_a_spare_that_dies_is_relaunched_without_a_regroup_and_a_spare_takes_a_lost_members_rank(digits, start_job, monkeypatch):
    monkeypatch.setenv("ELASTIC_STEP_LOCAL_FORKS", "1")  # the master's environment
    # Long enough for the relaunched spare to start and warm up (a fork: about a second), and a member to be
    # replaced by it after that, before the job ends.
    epochs = 16
    job = start_job("--data", digits, "--epochs", str(epochs), *FIXED)
    status = job.wait_for(lambda s: full_with_a_spare(s) and s["rows_done"] / s["rows_total"] < 0.25, timeout=300)
    first = spares(status)[0]
    assert first["rank"] is None and first["rows_applied"] == 0
    shown = cli("get", job.job_dir)
    assert "spares 1" in shown.stdout, shown.stdout
    assert re.search(rf"^{re.escape(first['id'])}\s+spare\s+live\s", shown.stdout, re.M), shown.stdout  # its RANK: spare

    # The spare dies: it is relaunched, and the members train on undisturbed.
    os.kill(first["pid"], signal.SIGKILL)
    relaunched = job.wait_for(lambda s: len(spares(s)) == 1 and spares(s)[0]["id"] != first["id"], timeout=300)
    assert relaunched["round"] == status["round"]
    spare = spares(relaunched)[0]
    assert spare["slot"] == first["slot"] and spare["rank"] is None and spare["rows_applied"] == 0

    # A member dies: the (relaunched, warmed up) spare takes its rank in the very next round.
    victim = job.kill_worker(relaunched, rank=1)
    after = job.wait_for(lambda s: s["round"] > relaunched["round"] and s["world_size"] == 3)
    ranks = {w["id"]: w["rank"] for w in after["workers"]}
    assert ranks[spare["id"]] is not None, after  # the spare is a member now
    assert victim["id"] not in [w["id"] for w in after["workers"] if w["rank"] is not None]
    assert job.finish() == 0, job.output()
    assert audit_report(job.audit, digits, epochs)["exact"]
    events = job.events()
    assert [e["worker"] for e in events if e["event"] == "died"] == [first["id"], victim["id"]]
    # Taken in the very next round that trains, not after a relaunch. (A survivor's report of the
    # failed collective can come a moment before the victim's exit: a round proposed then, with
    # the victim still in it, is replaced at the exit and never trains.)
    trained = [e for e in events if e["event"] == "regrouped" and e["round"] > relaunched["round"]]
    assert spare["id"] in trained[0]["members"], trained
    assert len(trained[0]["members"]) == 3
    assert any(e["event"] == "recovered" for e in events)
