"""Bad input: a clear message naming the input, a non-zero exit, and nothing left running."""

import json
import os
import socket

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import MODEL, cli, worker_processes

HERE = os.path.dirname(__file__)


def train(tmp_path, data, *extra, model=MODEL):
    job_dir = tmp_path / "job"
    done = cli("train", "--model-def", model, "--data", str(data), "--job-dir", str(job_dir), "--no-progress", *extra, timeout=180)
    return done, job_dir


def assert_clean_failure(done, job_dir, *words):
    assert done.returncode != 0
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith("elastic-step train: error:"), done.stderr
    for word in words:
        assert word in message, message
    assert not (job_dir / "logs").exists() or not os.listdir(job_dir / "logs"), "no worker may have started"


@pytest.mark.parametrize("workers,words", [("4:2", ["4:2", "larger than the maximum"]), ("0:2", ["0:2", "at least 1"]), ("x", ["'x'", "MIN:MAX"])])
def test_bad_worker_range(tmp_path, digits, workers, words):
    done, job_dir = train(tmp_path, digits, "--workers", workers)
    assert_clean_failure(done, job_dir, *words)


def test_missing_manifest(tmp_path):
    done, job_dir = train(tmp_path, tmp_path / "nowhere")
    assert_clean_failure(done, job_dir, "nowhere", "prepare-data")


def test_corrupt_manifest(tmp_path, digits):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "manifest.json").write_text(open(os.path.join(digits, "manifest.json")).read()[:100])
    done, job_dir = train(tmp_path, bad)
    assert_clean_failure(done, job_dir, "corrupt manifest", str(bad))


def copy_data(digits, tmp_path):
    import shutil

    copy = tmp_path / "data"
    shutil.copytree(digits, copy)
    return copy


def test_missing_shard(tmp_path, digits):
    data = copy_data(digits, tmp_path)
    os.remove(data / "train" / "part-00001.parquet")
    done, job_dir = train(tmp_path, data)
    assert_clean_failure(done, job_dir, "part-00001.parquet")


def test_shard_schema_differs_from_manifest(tmp_path, digits):
    data = copy_data(digits, tmp_path)
    shard = data / "train" / "part-00000.parquet"
    table = pq.read_table(shard)
    table = table.set_column(0, "pixel_0", table.column(0).cast(pa.float64()))
    pq.write_table(table, shard)
    done, job_dir = train(tmp_path, data)
    assert_clean_failure(done, job_dir, "part-00000.parquet", "pixel_0")


def test_model_definition_missing_a_function(tmp_path, digits):
    done, job_dir = train(tmp_path, digits, model=os.path.join(HERE, "model_defs", "no_optimizer.py"))
    assert_clean_failure(done, job_dir, "no_optimizer.py", "optimizer()")


def test_model_definition_raising_on_import(tmp_path, digits):
    done, job_dir = train(tmp_path, digits, model=os.path.join(HERE, "model_defs", "raises_on_import.py"))
    assert_clean_failure(done, job_dir, "raises_on_import.py", "cannot find my weights file")


def test_unknown_model_module(tmp_path, digits):
    done, job_dir = train(tmp_path, digits, model="no_such_module.models")
    assert_clean_failure(done, job_dir, "no_such_module.models")


def test_port_already_in_use(tmp_path, digits):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        done, job_dir = train(tmp_path, digits, "--port", str(port))
    finally:
        holder.close()
    assert_clean_failure(done, job_dir, str(port), "already in use")


def test_nan_loss_stops_the_job_and_says_at_which_step(tmp_path, digits):
    done, job_dir = train(tmp_path, digits, "--workers", "2", model=os.path.join(HERE, "model_defs", "exploding.py"))
    assert done.returncode == 1
    message = done.stderr.strip().splitlines()[-1]
    assert "loss is nan at step 6" in message, done.stderr
    assert not (job_dir / "model").exists()
    assert os.listdir(job_dir / "logs"), "workers did start"
    worker_log = (job_dir / "logs" / "w0.1.log").read_text()
    assert "round 1: 5 steps, " in worker_log and " ms per step: data " in worker_log  # where the time went
    assert worker_processes(str(job_dir)) == []


def test_a_worker_that_cannot_start_says_why_in_the_jobs_failure(tmp_path, digits):
    # The model definition imports in the master and not in its workers: the first worker's
    # pre-flight fails the job at once, saying why; no slot is relaunched into the same failure.
    done, job_dir = train(tmp_path, digits, "--workers", "1", "--max-relaunches", "1",
                          model=os.path.join(HERE, "model_defs", "fails_in_workers.py"))
    assert done.returncode == 1
    message = done.stderr.strip().splitlines()[-1]
    assert "worker w0.1 failed its pre-flight check: the model definition" in message, done.stderr
    assert "No module named 'a_package_only_the_master_has'" in message and "workers' image or venv" in message, done.stderr
    events = [json.loads(line)["event"] for line in (job_dir / "events.jsonl").read_text().splitlines()]
    assert "job_failed" in events and "relaunched" not in events, events
    assert worker_processes(str(job_dir)) == []
