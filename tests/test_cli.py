"""The `elastic-step` command line as a user types it."""

import json
import os

from conftest import SLOW_MODEL, cli


def test_prepare_data_writes_a_manifest_and_says_what_it_did(tmp_path):
    done = cli("prepare-data", "--source", "sklearn:digits", "--out", str(tmp_path / "d"), "--split", "0.7,0.15,0.15")
    assert done.returncode == 0, done.stderr
    assert "train 1257, val 270, test 270" in done.stdout and "64 features" in done.stdout
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert sum(s["rows"] for split in manifest["splits"].values() for s in split) == 1797


def test_prepare_data_bad_split_and_unknown_dataset(tmp_path):
    done = cli("prepare-data", "--source", "sklearn:digits", "--out", str(tmp_path / "d"), "--split", "0.8,x")
    assert done.returncode != 0 and "--split" in done.stderr and "0.8,x" in done.stderr
    done = cli("prepare-data", "--source", "sklearn:nope", "--out", str(tmp_path / "d"))
    assert done.returncode != 0 and "nope" in done.stderr and "digits" in done.stderr
    assert not (tmp_path / "d" / "manifest.json").exists()


def test_status_and_scale_of_a_running_job(digits, start_job):
    """`status` is `get` by another name; JOB is positional, and --job-dir, as both took it before, still works."""
    job = start_job("--data", digits, "--workers", "2:3", "--epochs", "6", "--model-def", SLOW_MODEL, "--minibatch-size", "16")
    job.wait_for(lambda s: s["world_size"] == 3 and s["rows_done"] > 0)
    text = cli("status", job.job_dir)
    assert text.returncode == 0, text.stderr
    assert "running" in text.stdout and "w0.1" in text.stdout and "PID" in text.stdout.upper()
    view = json.loads(cli("status", "--job-dir", job.job_dir, "--json").stdout)
    pids = [w["pid"] for w in view["workers"]]
    assert pids and all(os.path.exists(f"/proc/{pid}") for pid in pids)
    refused = cli("scale", job.job_dir, "--workers", "5")
    assert refused.returncode == 2 and "2:3" in refused.stderr
    assert job.finish() == 0, job.output()
    ended = cli("status", job.job_dir)
    assert ended.returncode == 0 and "succeeded" in ended.stdout, ended.stdout + ended.stderr
    gone = cli("scale", job.job_dir, "--workers", "2")
    assert gone.returncode != 0 and "not running" in gone.stderr


def test_status_of_a_folder_without_a_job(tmp_path):
    done = cli("status", "--job-dir", str(tmp_path))
    assert done.returncode == 2 and "no job" in done.stderr and str(tmp_path) in done.stderr
    unnamed = cli("get")
    assert unnamed.returncode == 2 and "name the job" in unnamed.stderr and len(unnamed.stderr.strip().splitlines()) == 1


def test_the_cli_names_its_version_and_keeps_the_worker_command_out_of_its_help():
    from elastic_step import __version__

    assert cli("--version").stdout.strip() == f"elastic-step {__version__}"
    listed = cli("--help").stdout
    assert " get (status)" in listed and "\n    worker " not in listed
    assert cli("worker", "--help").returncode == 0


def test_warm_start_alias_trains_from_scratch_while_there_is_no_champion(digits, tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    done = cli("train", "--model-def", "elastic_step.model_zoo.digits_torch", "--data", digits, "--job-dir", str(tmp_path / "job"),
               "--workers", "1", "--epochs", "1", "--minibatch-size", "128", "--no-progress", "--mlflow-uri", uri,
               "--registered-model", "nobody", "--warm-start-alias", "champion")
    assert done.returncode == 0, done.stderr
    assert "nobody has no @champion yet; training from scratch" in done.stderr
    lonely = cli("train", "--model-def", "elastic_step.model_zoo.digits_torch", "--data", digits, "--job-dir", str(tmp_path / "j2"),
                 "--warm-start-alias", "champion")
    assert lonely.returncode != 0 and "--registered-model" in lonely.stderr
