"""Watching a live local job whose workers are real processes, one of them killed mid-run: `get`
(table, JSON, YAML, -e), `list`, `top` and `logs` show what happened, and the job once ended."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from elastic_step.cli import main

from conftest import SLOW_MODEL, cli, resume_exactly
from test_reports import read_scalars

pytestmark = pytest.mark.e2e


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


EPOCHS = 10


def test_watch_a_live_job_then_stop_it_and_resume_it_exactly(digits, start_job, capsys):
    args = ["--data", digits, "--workers", "2:3", "--epochs", str(EPOCHS), "--model-def", SLOW_MODEL,
            "--minibatch-size", "16", "--minibatches-per-task", "2", "--checkpoint-steps", "25"]
    job = start_job(*args)
    status = job.wait_for(lambda s: s["world_size"] == 3 and s["rows_done"] > 0
                          and all(w["resources"] for w in s["workers"] if w["state"] == "live"), timeout=300)

    code, out, _ = run(capsys, "get", job.job_dir, "-o", "json")
    view = json.loads(out)
    assert code == 0 and view["summary"]["state"] == "running" and view["summary"]["live"]
    assert view["summary"]["rows_total"] > 0 and view["summary"]["mlflow"]["run_id"]
    assert view["summary"]["ui"].startswith("http://127.0.0.1:") and "#token=" in view["summary"]["ui"]
    assert sorted(w["id"] for w in view["workers"]) == ["w0.1", "w1.1", "w2.1"]
    for w in view["workers"]:
        assert w["pid"] > 0 and w["rss_bytes"] > 50 * 2**20 and w["cpu_percent"] >= 0 and w["heartbeat_age_s"] < 10

    victim = job.kill_worker(status, rank=1)
    job.wait_for(lambda s: any(w["id"] == f"w{victim['slot']}.2" and w["state"] == "live" for w in s["workers"])
                 and s["round_ready"] and s["round"] >= 2, timeout=120)

    code, out, _ = run(capsys, "get", job.job_dir, "-e")
    assert code == 0
    assert re.search(rf"w{victim['slot']}\.2 .* 1 \(killed by SIGKILL\)", out), out
    for word in ("job job: running", "died", "relaunched", "regrouped", "samples/s", "tensorboard --logdir"):
        assert word in out, (word, out)

    code, out, _ = run(capsys, "get", job.job_dir, "-e", "-o", "yaml")
    view = yaml.safe_load(out)
    slot = next(w for w in view["workers"] if w["slot"] == victim["slot"])
    assert slot["relaunches"] == 1 and slot["relaunch_causes"] == ["killed by SIGKILL"]
    kinds = [e["event"] for e in view["events"]]
    assert {"died", "relaunched", "regrouped"} <= set(kinds), kinds

    code, out, _ = run(capsys, "list", "--root", os.path.dirname(job.job_dir))
    assert code == 0 and re.search(r"^job\s+running\s", out, re.M), out

    code, out, _ = run(capsys, "top", job.job_dir, "-r", "0.2", "--iterations", "2")
    assert code == 0 and "w0.1" in out and "RELAUNCHES" in out
    code, out, _ = run(capsys, "top", "--root", os.path.dirname(job.job_dir), "-r", "0.2", "--iterations", "1")
    assert code == 0 and re.search(r"^job\s+running\s", out, re.M), out

    code, out, _ = run(capsys, "logs", job.job_dir, "--worker", f"w{victim['slot']}", "--previous")
    assert code == 0 and out.strip(), "the killed attempt's log"
    code, out, _ = run(capsys, "logs", job.job_dir, "--master", "--tail", "3", "--timestamps", "--since", "1h")
    lines = out.splitlines()
    assert code == 0 and len(lines) == 3 and all(re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}", line) for line in lines), lines

    # Following the master's log goes on until the job ends, and ends by itself then.
    follower = subprocess.Popen([sys.executable, "-m", "elastic_step.cli", "logs", job.job_dir, "--master", "-f", "--tail", "1"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Its newest line comes first, once it has read the log: from then on it follows. Only
        # then is the stop asked for, so its lines cannot come before the follower starts.
        newest = follower.stdout.readline()
        assert newest, follower.stderr.read()
        before = job.status()
        stopped = cli("stop", job.job_dir, timeout=600)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        step = int(re.search(r"stopped at its checkpoint of step (\d+)", stopped.stdout).group(1))
        assert step > before["step"]  # a checkpoint taken for the stop, not an older one
        followed, _ = follower.communicate(timeout=60)
        followed = newest + followed
    finally:
        follower.kill()
    assert "stop_requested" in followed and "stopped" in followed
    assert job.finish() == 0, job.output()
    assert "stopped" in job.output() and "--resume" in job.output()
    assert before["rows_done"] < before["rows_total"] or before["epoch"] < EPOCHS - 1

    code, out, _ = run(capsys, "get", job.job_dir, "-e")
    assert code == 0 and "job job: stopped" in out and "stop_requested" in out, out
    from mlflow.tracking import MlflowClient

    stopped_result = json.load(open(os.path.join(job.job_dir, "result.json")))
    assert stopped_result["state"] == "stopped" and stopped_result["checkpoint_step"] == step
    assert stopped_result["relaunches"] == 1 and stopped_result["regroups"] >= 2
    run_id = stopped_result["run_id"]
    mlflow = MlflowClient(f"sqlite:///{os.path.join(job.job_dir, 'mlflow.db')}")
    assert mlflow.get_run(run_id).info.status == "KILLED"
    assert mlflow.get_run(run_id).data.tags["elastic_step.checkpoint"] == str(step)
    assert stop_refused_once_ended(job.job_dir)

    # The restart history where people look: MLflow metrics, TensorBoard scalars, the HTML report.
    assert [m.value for m in mlflow.get_metric_history(run_id, "relaunches")] == [1]
    assert mlflow.get_metric_history(run_id, "regroups")[-1].value >= 2
    assert mlflow.get_metric_history(run_id, "recovery_s")
    artifacts = {a.path for a in mlflow.list_artifacts(run_id)} | {a.path for a in mlflow.list_artifacts(run_id, "plots")}
    assert "tensorboard" in artifacts and "plots/report.html" in artifacts, artifacts
    scalars = read_scalars(os.path.join(job.job_dir, "tensorboard"))
    assert {v for _, v in scalars["train/world_size"]} == {2.0, 3.0}
    assert scalars["membership/recovery_s"] and scalars["membership/relaunches"][-1][1] == 1.0
    assert len(scalars["train/loss"]) >= before["step"]
    report = open(os.path.join(job.job_dir, "plots", "report.html")).read()
    assert "killed by SIGKILL" in report and report.count('<path class="series"') == 3

    second, resumed_from = resume_exactly(start_job, args, digits, epochs=EPOCHS)
    assert resumed_from == step
    assert mlflow.get_run(run_id).info.status == "FINISHED"
    assert second.result()["relaunches"] == 0 and second.result()["regroups"] >= 1
    scalars = read_scalars(os.path.join(job.job_dir, "tensorboard"))
    assert scalars["validation/accuracy"] and max(step for step, _ in scalars["train/loss"]) == second.result()["steps"]
    code, out, _ = run(capsys, "get", job.job_dir)
    assert code == 0 and "job job: succeeded" in out and "accuracy" in out and "ended" in out, out
    assert "live page" not in out  # no master to serve it
    code, out, _ = run(capsys, "list", "--root", os.path.dirname(job.job_dir), "-o", "json")
    assert json.loads(out)[0]["state"] == "succeeded"


def stop_refused_once_ended(job_dir: str) -> bool:
    again = cli("stop", job_dir)
    assert again.returncode != 0 and len(again.stderr.strip().splitlines()) == 1, again.stderr
    return "has ended (stopped)" in again.stderr
