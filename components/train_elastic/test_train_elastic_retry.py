"""A retried train_elastic task, as KFP runs one: each attempt is a new process in a new pod (here: a
new process and a fresh folder; `kfp.local` itself ignores retries), with the same pipeline run
id. The first attempt is preempted (SIGTERM) mid-epoch and exits 75 after its checkpoint; the
second resumes that run from it, and the two attempts' audits together apply every row of every
epoch exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from mlflow.tracking import MlflowClient

from elastic_step.audit import audit_report
from elastic_step.exit_codes import ExitCode
from elastic_step.operate.client import try_status

pytestmark = pytest.mark.e2e

SLOW_MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "model_defs", "slow_digits.py")
ATTEMPT = """
import sys
from kfp.dsl import HTML, Dataset, Metrics, Model
from elastic_step.components import train_elastic

data, folder, model_def, mlflow_uri = sys.argv[1:]
train_elastic.python_func(
    dataset=Dataset(uri=data), model=Model(uri=folder + "/model"), metrics=Metrics(uri=folder + "/metrics"),
    report=HTML(uri=folder + "/report.html"), model_def=model_def, workers="2", epochs=2, minibatch_size=16,
    minibatches_per_task=2, checkpoint_steps=1000, mlflow_uri=mlflow_uri, pipeline_run_id="pipeline-run-7",
    job_dir=folder + "/job")
"""


def attempt(dataset, folder, mlflow_uri) -> subprocess.Popen:
    os.makedirs(folder)
    log = open(os.path.join(folder, "out.txt"), "w")
    return subprocess.Popen([sys.executable, "-c", ATTEMPT, dataset.uri, folder, os.path.abspath(SLOW_MODEL), mlflow_uri],
                            stdout=log, stderr=subprocess.STDOUT)


def output(folder) -> str:
    with open(os.path.join(folder, "out.txt")) as f:
        return f.read()


def test_a_preempted_task_exits_75_and_its_retry_resumes_the_run_exactly(dataset, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first_dir, second_dir = str(tmp_path / "attempt-1"), str(tmp_path / "attempt-2")
    first = attempt(dataset, first_dir, uri)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and first.poll() is None:
            status = try_status(os.path.join(first_dir, "job"))
            if status and status["epoch"] == 0 and status["rows_done"] > 0.15 * status["rows_total"]:
                break
            time.sleep(0.1)
        assert first.poll() is None, output(first_dir)
        first.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        assert first.wait(60) == ExitCode.PREEMPTED, output(first_dir)
        assert time.monotonic() - sent < 30  # the pod's grace period (Kubernetes' default, the project's)
    finally:
        if first.poll() is None:
            first.kill()
    with open(os.path.join(first_dir, "job", "result.json")) as f:
        preempted = json.load(f)
    assert preempted["state"] == "preempted" and preempted["checkpoint_step"], preempted

    second = attempt(dataset, second_dir, uri)  # a new pod: nothing of the first attempt's folder
    assert second.wait(600) == 0, output(second_dir)
    assert f"resuming run {preempted['run_id']} from its checkpoint of step {preempted['checkpoint_step']}" in output(second_dir)
    combined = str(tmp_path / "audit.jsonl")
    with open(combined, "w") as out:
        for folder in (first_dir, second_dir):
            with open(os.path.join(folder, "job", "audit.jsonl")) as f:
                out.write(f.read())
    report = audit_report(combined, dataset.path, epochs=2)
    assert report["exact"], report
    run = MlflowClient(uri).get_run(preempted["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["elastic_step.state"] == "succeeded"
