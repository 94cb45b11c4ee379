"""Warm spares (`--spares K`): extra workers that start, warm up and wait; a lost member's rank
goes to a spare in the next round, with no relaunch to wait for. Real processes, real signals."""

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


def test_a_spare_takes_a_lost_members_rank_and_never_holds_a_task(digits, start_job):
    job = start_job("--data", digits, "--epochs", "4", *FIXED)
    status = job.wait_for(full_with_a_spare)
    spare = spares(status)[0]
    assert spare["rank"] is None and spare["rows_applied"] == 0
    shown = cli("get", job.job_dir)
    assert "spares 1" in shown.stdout, shown.stdout
    assert re.search(rf"^{re.escape(spare['id'])}\s+spare\s+live\s", shown.stdout, re.M), shown.stdout  # its RANK: spare
    victim = job.kill_worker(status, rank=1)
    after = job.wait_for(lambda s: s["round"] > status["round"] and s["world_size"] == 3)
    ranks = {w["id"]: w["rank"] for w in after["workers"]}
    assert ranks[spare["id"]] is not None, after  # the spare is a member now
    assert victim["id"] not in [w["id"] for w in after["workers"] if w["rank"] is not None]
    assert job.finish() == 0, job.output()
    report = audit_report(job.audit, digits, 4)
    assert report["exact"], report
    events = job.events()
    proposed = [e for e in events if e["event"] == "round_proposed" and e["round"] > status["round"]]
    assert spare["id"] in proposed[0]["members"]  # taken in the very next round, not after a relaunch
    assert len(proposed[0]["members"]) == 3
    assert any(e["event"] == "recovered" for e in events)


def test_a_spare_that_dies_is_relaunched_and_the_group_does_not_regroup(digits, start_job):
    # Long enough for the relaunched spare to start and warm up (seconds) before the job ends.
    job = start_job("--data", digits, "--epochs", "20", *FIXED)
    status = job.wait_for(lambda s: full_with_a_spare(s) and s["rows_done"] / s["rows_total"] < 0.25)
    spare = spares(status)[0]
    os.kill(spare["pid"], signal.SIGKILL)
    relaunched = job.wait_for(lambda s: len(spares(s)) == 1 and spares(s)[0]["id"] != spare["id"])
    assert relaunched["round"] == status["round"]  # the members trained on, undisturbed
    assert spares(relaunched)[0]["slot"] == spare["slot"]
    assert job.finish() == 0, job.output()
    assert audit_report(job.audit, digits, 20)["exact"]
    died = [e for e in job.events() if e["event"] == "died"]
    assert [e["worker"] for e in died] == [spare["id"]]
