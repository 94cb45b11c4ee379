"""Resuming at the edges, with real jobs: a master killed before its first checkpoint, a resume
with other data, model or task size, a torn audit line, workers of a killed master, and a
tracking URI with a password in it."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from mlflow.tracking import MlflowClient

from elastic_step.audit import audit_report

from conftest import MODEL, SLOW_MODEL, cli, kill_master, resume_exactly, worker_processes

pytestmark = pytest.mark.e2e

FAST = ["--minibatch-size", "16", "--minibatches-per-task", "2"]


def events(job_dir: str) -> list[dict]:
    path = os.path.join(job_dir, "events.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def first_loss(job_dir: str) -> float:
    with open(os.path.join(job_dir, "metrics.jsonl")) as f:
        return json.loads(f.readline())["loss"]


def test_resume_before_the_first_checkpoint_starts_over_exactly_and_keeps_the_warm_start(digits, start_job, mlflow_server, trained_run):
    # The champion: a finished 2-epoch run of MODEL on the same tracking server.
    base, champion = trained_run, trained_run.result()["run_id"]

    # A retraining step that warm-starts from the champion; no checkpoint before the epoch ends.
    args = ["--data", digits, "--workers", "2", "--epochs", "2", "--model-def", SLOW_MODEL, *FAST,
            "--mlflow-uri", mlflow_server.uri, "--experiment", "resume-before-checkpoint",
            "--checkpoint-steps", "1000", "--init-from", champion]
    first = start_job(*args, name="job")
    first.wait_for(lambda s: s["rows_done"] > 0.15 * s["rows_total"])
    kill_master(first)
    assert not [e for e in events(first.job_dir) if e["event"] == "checkpoint"]
    assert os.path.getsize(first.audit) > 0  # the first attempt did apply rows

    second = start_job(*args, "--resume", name="job")
    assert second.finish() == 0, second.output()
    assert "starting from the beginning" in second.output()
    markers = [json.loads(line)["resume_from_step"] for line in open(second.audit) if "resume_from_step" in line]
    assert markers == [0]
    report = audit_report(second.audit, digits, epochs=2)
    assert report["exact"], report
    assert report["rows_applied"] == second.result()["rows_audited"]
    # warm: the first step of the attempt that counted starts from the champion, not from scratch
    assert first_loss(second.job_dir) < 0.5 * first_loss(base.job_dir)


def test_a_sigkilled_master_resumes_exactly_past_a_torn_audit_line_and_refuses_other_data_model_or_task_size(digits, start_job, tmp_path):
    # An elastic group (2:3), its master SIGKILLed in the second epoch, past its checkpoints.
    args = ["--data", digits, "--workers", "2:3", "--epochs", "2", "--model-def", SLOW_MODEL, *FAST, "--checkpoint-steps", "15",
            "--master-timeout", "5"]
    first = start_job(*args, name="job")
    first.wait_for(lambda s: s["epoch"] >= 1 and s["rows_done"] > 0.55 * s["rows_total"]
                   and any(e["event"] == "checkpoint" for e in events(first.job_dir)))
    assert worker_processes(first.job_dir)
    kill_master(first)
    audit_before = open(first.audit, "rb").read()
    client = MlflowClient(f"sqlite:///{os.path.join(first.job_dir, 'mlflow.db')}")
    run = client.search_runs([client.get_experiment_by_name("elastic-step").experiment_id])[0]
    status_before = run.info.status

    from elastic_step.data.prepare import prepare_data

    other_data = str(tmp_path / "other-digits")
    prepare_data("sklearn:digits", other_data, rows_per_shard=256, seed=1)
    other_model = str(tmp_path / "other_model.py")
    shutil.copy(SLOW_MODEL, other_model)
    cases = {
        "task size": ["--minibatch-size", "8"],
        "data content hash": ["--data", other_data],
        "model definition": ["--model-def", other_model],
    }
    # The three refusals at once: each is a master's whole start-up, and none writes anything.
    with ThreadPoolExecutor(len(cases)) as pool:
        refused = dict(zip(cases, pool.map(
            lambda change: cli("train", *args, *change, "--job-dir", first.job_dir, "--audit", first.audit,
                               "--no-progress", "--resume", timeout=180), cases.values())))
    for what, done in refused.items():
        assert done.returncode != 0, (what, done.stdout, done.stderr)
        message = done.stderr.strip().splitlines()[-1]
        assert f"cannot resume run {run.info.run_id}" in message and what in message, message
        assert "--job-name" in message  # and what to do
        assert open(first.audit, "rb").read() == audit_before  # nothing written
        assert client.get_run(run.info.run_id).info.status == status_before

    # A crash mid-write tore the audit's last line: the resume cuts it and appends its marker whole.
    with open(first.audit, "a") as f:
        f.write('{"epoch": 1, "shard": "train-000')
    resume_exactly(start_job, args, digits, epochs=2)


def test_workers_leave_within_5s_of_their_master_being_killed(digits, start_job):
    job = start_job("--data", digits, "--workers", "3", "--epochs", "5", "--model-def", SLOW_MODEL, *FAST,
                    "--master-timeout", "60")
    job.wait_for(lambda s: s["world_size"] == 3 and s["rows_done"] > 0)
    assert len(worker_processes(job.job_dir)) >= 3  # the 3 workers (and their warm parent, when forked)
    job.proc.send_signal(signal.SIGKILL)
    job.proc.wait()
    killed = time.monotonic()
    while worker_processes(job.job_dir) and time.monotonic() - killed < 30:
        time.sleep(0.1)
    took = time.monotonic() - killed
    assert not worker_processes(job.job_dir), "workers outlived their master"
    assert took < 5.5, f"workers took {took:.1f}s to leave a dead master"
    # Each left through its main thread (its exit path logged the code), not from a background thread.
    logs = glob.glob(os.path.join(job.job_dir, "logs", "w*.log"))
    assert len(logs) == 3, logs
    for path in logs:
        text = open(path, errors="replace").read()
        assert "worker leaves: master at" in text and "(exit code 3)" in text, (path, text[-2000:])
        assert "stacks follow" not in text, (path, text[-2000:])


TRAIN_STEP = """
import json, sys
from elastic_step.training_step import train_step
result = train_step(data=sys.argv[1], model_dir=sys.argv[2], model_def=sys.argv[3], workers="2", epochs=1,
                    minibatch_size=16, minibatches_per_task=2, checkpoint_steps=10, mlflow_uri=sys.argv[4],
                    experiment="credentials", job_dir=sys.argv[5], job_name="credentials")
print(json.dumps(result.model_metadata()))
"""


def test_the_tracking_uri_password_is_nowhere_and_planted_links_are_replaced_not_followed(digits, mlflow_server, tmp_path):
    password = "hunter2-s3cret"
    uri = mlflow_server.uri.replace("http://", f"http://alice:{password}@")
    job_dir = tmp_path / "job"
    (job_dir / "model").mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    for planted in ("token", "master.json", "result.json", "model/model.bin", "model/model.json"):
        (job_dir / planted).symlink_to(victim)
    done = subprocess.run([sys.executable, "-c", TRAIN_STEP, digits, str(tmp_path / "out"), MODEL, uri, str(job_dir)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert victim.read_text() == "precious"
    for planted in ("token", "master.json", "result.json", "model/model.bin", "model/model.json"):
        assert not (job_dir / planted).is_symlink(), planted
    assert oct((job_dir / "token").stat().st_mode & 0o777) == oct(0o600)

    assert password not in done.stdout and password not in done.stderr
    metadata = json.loads(done.stdout.strip().splitlines()[-1])
    assert password not in json.dumps(metadata) and metadata["mlflow_uri"].startswith("http://alice:***@")
    result = json.load(open(job_dir / "result.json"))
    assert password not in json.dumps(result)
    for folder in (job_dir, tmp_path / "out"):
        for root, _, files in os.walk(folder):
            for name in files:
                with open(os.path.join(root, name), "rb") as f:
                    assert password.encode() not in f.read(), os.path.join(root, name)
    run = MlflowClient(mlflow_server.uri).get_run(metadata["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    recorded = json.dumps({"params": run.data.params, "tags": run.data.tags})
    assert password not in recorded
    assert run.data.params["mlflow_uri"].startswith("http://alice:***@")
