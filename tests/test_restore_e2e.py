"""End to end with real worker processes and real signals: every worker of the group SIGKILLed at
once, after a checkpoint. The master restores the group from that checkpoint (without restarting
itself), the job succeeds, and the audit holds every row of every epoch exactly once."""

import json
import os
import signal

import pytest
from mlflow.tracking import MlflowClient

from elastic_step.audit import audit_report

from conftest import SLOW_MODEL

pytestmark = pytest.mark.e2e

EPOCHS = 2


def checkpoints(job) -> list[int]:
    """The steps of the checkpoints the master has handed over so far."""
    if not os.path.exists(os.path.join(job.job_dir, "events.jsonl")):
        return []
    return [e["step"] for e in job.events() if e["event"] == "checkpoint"]


def test_every_worker_sigkilled_at_once_the_job_goes_on_from_the_masters_checkpoint(digits, start_job):
    job = start_job("--data", digits, "--workers", "2", "--epochs", str(EPOCHS), "--model-def", SLOW_MODEL,
                    "--minibatch-size", "16", "--minibatches-per-task", "2", "--checkpoint-steps", "10")
    status = job.wait_for(lambda s: s["world_size"] == 2 and checkpoints(job), timeout=180)
    first_checkpoint = checkpoints(job)[0]
    live = [w for w in status["workers"] if w["state"] == "live"]
    assert len(live) == 2
    for worker in live:
        os.kill(worker["pid"], signal.SIGKILL)
    assert job.finish() == 0, job.output()

    events = job.events()
    kinds = [e["event"] for e in events]
    restored = [e for e in events if e["event"] == "restored"]
    assert len(restored) == 1, kinds
    newest_checkpoint = [e["step"] for e in events[:kinds.index("restored")] if e["event"] == "checkpoint"][-1]
    assert restored[0]["step"] == newest_checkpoint >= first_checkpoint
    assert f"checkpoint of step {newest_checkpoint}" in restored[0]["message"]
    with open(os.path.join(job.job_dir, "logs", "master.log")) as f:  # `elastic-step logs --master`
        assert f"{restored[0]['steps_lost']} steps are lost" in f.read()
    assert {e["worker"] for e in events if e["event"] == "died"} >= {w["id"] for w in live}
    report = audit_report(job.audit, digits, EPOCHS)
    assert report["exact"], report
    assert report["rows_applied"] == report["rows_expected"] == job.result()["rows_audited"]
    # What `get` shows per worker adds up to the rows trained, not counting the steps the restore
    # went back over twice; and the run's loss history has each step once.
    with open(os.path.join(job.job_dir, "status.json")) as f:
        workers = json.load(f)["workers"]
    assert sum(w["rows_applied"] for w in workers) == report["rows_applied"], workers
    with open(os.path.join(job.job_dir, "mlflow_run.json")) as f:
        run = json.load(f)
    client = MlflowClient(run["tracking_uri"])
    steps = [m.step for m in client.get_metric_history(run["run_id"], "loss")]
    assert len(steps) == len(set(steps)), sorted(steps)
    assert [m.value for m in client.get_metric_history(run["run_id"], "restores")] == [1]
