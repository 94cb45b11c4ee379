"""Data in object stores, against real servers on 127.0.0.1: S3 (moto's server) and GCS
(fake-gcs-server). Datasets load and shards read from s3:// and gs://; a worker process reaches
the store with nothing but the standard environment; store failures are one line naming the URI
and what to check; KFP's minio:// artifact URIs resolve; and a whole elastic job whose data,
checkpoints and model live in S3 survives a SIGKILLed worker with an exact audit."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from stores import GcsServer, S3Server, fresh_filesystems, free_port, upload_folder

from conftest import SLOW_MODEL, cli

from elastic_step.data import stores
from elastic_step.data.manifest import load_manifest, validate_shards
from elastic_step.data.reader import ShardReader
from elastic_step.errors import ConfigError, DataError

BUCKET = "data"


@pytest.fixture(scope="session")
def s3_server():
    server = S3Server().start()
    server.create_bucket(BUCKET)
    yield server
    server.stop()


def pointed_at(server, monkeypatch):
    """The server, with this process's environment (and so its children's) pointing at it, and no
    filesystem cached from before; the cache is dropped again after the test."""
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    fresh_filesystems()
    yield server
    fresh_filesystems()


@pytest.fixture
def s3(s3_server, monkeypatch):
    yield from pointed_at(s3_server, monkeypatch)


@pytest.fixture
def s3_digits(s3, digits):
    uri = f"s3://{BUCKET}/digits"
    if not stores.resolve(uri)[0].exists(f"{BUCKET}/digits/manifest.json"):
        upload_folder(digits, uri)
    return uri


@pytest.fixture(scope="session")
def gcs_server():
    server = GcsServer().start()
    server.create_bucket(BUCKET)
    yield server
    server.stop()


@pytest.fixture
def gcs(gcs_server, monkeypatch):
    yield from pointed_at(gcs_server, monkeypatch)


def same_rows(manifest_uri: str, local: str) -> None:
    remote, here = ShardReader(load_manifest(manifest_uri)), ShardReader(load_manifest(local))
    for shard, start, count in [(0, 0, 256), (1, 10, 100), (len(here.manifest.splits["train"]) - 1, 3, 40)]:
        a, b = remote.read("train", shard, start, count), here.read("train", shard, start, count)
        assert a.keys() == b.keys()
        for column in a:
            np.testing.assert_array_equal(a[column], b[column])
    np.testing.assert_array_equal(remote.read_split("test")["label"], here.read_split("test")["label"])


def test_manifest_and_shards_from_s3(s3_digits, digits):
    manifest = load_manifest(s3_digits)
    assert manifest.root == s3_digits
    assert manifest.shard_uri("train", 0) == f"{s3_digits}/train/part-00000.parquet"
    validate_shards(manifest, ["train", "val", "test"])
    same_rows(s3_digits + "/manifest.json", digits)


def test_a_small_shard_in_a_store_is_read_in_one_request(s3_server, s3_digits, digits):
    """The manifest records each shard's size, so a worker fetches a small shard whole in one
    GET (not its size, then its footer, then its row groups), and its later ranges cost none:
    counted in the S3 server's own request log."""
    manifest = load_manifest(s3_digits)
    for split, shards in load_manifest(digits).splits.items():
        assert [s.bytes for s in shards] == [os.path.getsize(os.path.join(digits, s.path)) for s in shards]
        assert [s.bytes for s in manifest.splits[split]] == [s.bytes for s in shards]
    shard = manifest.shard_uri("train", 1).split("://", 1)[1]

    def requests() -> list[str]:
        with open(s3_server.log) as f:
            return [line for line in f if f"/{shard} HTTP" in line]

    before = len(requests())
    reader, local = ShardReader(manifest), ShardReader(load_manifest(digits))
    for start, count in [(0, 50), (50, 100), (200, 56)]:
        np.testing.assert_array_equal(reader.read("train", 1, start, count)["label"],
                                      local.read("train", 1, start, count)["label"])
    made = requests()[before:]
    assert len(made) == 1 and "GET /" in made[0], made


def test_manifest_and_shards_from_gcs(gcs, digits):
    uri = f"gs://{BUCKET}/digits"
    upload_folder(digits, uri)
    manifest = load_manifest(uri)
    assert manifest.root == uri
    validate_shards(manifest, ["train", "test"])
    same_rows(uri, digits)


def worker_like_process(code: str, env: dict) -> subprocess.CompletedProcess:
    """A fresh process with exactly `env` (plus PATH/HOME): what a worker pod starts with."""
    base = {k: os.environ[k] for k in ("PATH", "HOME", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT") if k in os.environ}
    return subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, timeout=120)


def test_a_fresh_process_reaches_s3_from_the_standard_environment_alone(s3_server, s3_digits):
    code = (f"from elastic_step.data.manifest import load_manifest; from elastic_step.data.reader import ShardReader\n"
            f"m = load_manifest({s3_digits!r}); print(m.rows('train'), len(ShardReader(m).read('train', 2, 5, 7)['label']))")
    done = worker_like_process(code, s3_server.env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(load_manifest(s3_digits).rows("train")), "7"]


def test_storage_options_reach_workers_through_worker_env(s3_server, s3_digits, monkeypatch):
    """--storage-option endpoint_url=...: the master applies it, and a worker that has only
    worker_env() (no AWS_ENDPOINT_URL) reaches the same store."""
    monkeypatch.setattr(stores, "_applied", {})
    monkeypatch.setattr("fsspec.config.conf", {})
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    stores.set_storage_options(s3_digits, {"endpoint_url": s3_server.endpoint})
    env = stores.worker_env()
    assert env == {"FSSPEC_S3": json.dumps({"endpoint_url": s3_server.endpoint}), "AWS_REGION": "us-east-1",
                   "AWS_DEFAULT_REGION": "us-east-1", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    credentials = {k: v for k, v in s3_server.env().items() if k != "AWS_ENDPOINT_URL"}
    code = f"from elastic_step.data.manifest import load_manifest; print(load_manifest({s3_digits!r}).rows('train'))"
    assert worker_like_process(code, credentials).returncode != 0  # without the option: real AWS, which fails
    done = worker_like_process(code, {**credentials, **env})
    assert done.returncode == 0, done.stderr


def test_a_worker_started_with_worker_env_has_the_options_with_their_types(monkeypatch):
    """fsspec reads `FSSPEC_<PROTOCOL>` as a JSON object when it is imported: a worker process
    started with worker_env() (and nothing else) holds the very options applied here, a bool as a
    bool, a dict as a dict, a URL without quotes around it."""
    monkeypatch.setattr(stores, "_applied", {})
    monkeypatch.setattr("fsspec.config.conf", {})
    for name in stores.STORE_LOCATION_ENV:
        monkeypatch.delenv(name, raising=False)
    options = {"endpoint_url": "http://minio:9000", "anon": False, "client_kwargs": {"region_name": "eu-west-1"},
               "default_block_size": 1048576}
    stores.set_storage_options("s3://bucket/data", options)
    env = stores.worker_env()
    assert list(env) == ["FSSPEC_S3"]
    code = "import json, fsspec, fsspec.config; print(json.dumps(fsspec.config.conf.get('s3')))"
    done = worker_like_process(code, env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == options
    assert "Ignoring environment variable" not in done.stderr


@pytest.mark.parametrize("option", ["key=abc", "secret=abc", "token=abc", "password=x", "session_token=x",
                                    'client_kwargs={"aws_secret_access_key": "x"}'])
def test_a_credential_as_storage_option_is_refused(option, monkeypatch):
    monkeypatch.setattr(stores, "_applied", {})
    with pytest.raises(ConfigError, match="looks like a credential") as caught:
        stores.set_storage_options("s3://bucket/data", dict([stores.parse_storage_option(option)]))
    assert "abc" not in str(caught.value) and "\n" not in str(caught.value)
    assert not [k for k in stores.worker_env() if k.startswith("FSSPEC_")]


def test_train_refuses_a_credential_storage_option_before_anything_starts(tmp_path):
    done = cli("train", "--model-def", SLOW_MODEL, "--data", "s3://bucket/data", "--job-dir", str(tmp_path / "job"),
               "--storage-option", "secret=do-not-print-me", timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert "looks like a credential" in done.stderr and "AWS_SECRET_ACCESS_KEY" in done.stderr
    assert "do-not-print-me" not in done.stderr + done.stdout


def test_workers_get_the_store_location_but_never_the_credentials(s3):
    env = stores.worker_env()
    assert env["AWS_ENDPOINT_URL"] == s3.endpoint and env["AWS_REGION"] == "us-east-1"
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"} & set(env)
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in json.dumps(env)


def test_storage_option_values_are_json_or_strings():
    assert stores.parse_storage_option("anon=true") == ("anon", True)
    assert stores.parse_storage_option("endpoint_url=http://minio:9000") == ("endpoint_url", "http://minio:9000")
    assert stores.parse_storage_option('client_kwargs={"region_name": "eu-west-1"}') == ("client_kwargs", {"region_name": "eu-west-1"})
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        stores.parse_storage_option("no-equals-sign")


# -- failures: one line naming the URI and what to check ------------------------------------------

def test_unreachable_endpoint_cli_exits_2_naming_the_uri_and_AWS_ENDPOINT_URL(s3, tmp_path, monkeypatch):
    closed = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", closed)
    done = cli("train", "--model-def", SLOW_MODEL, "--data", f"s3://{BUCKET}/digits", "--job-dir", str(tmp_path / "job"),
               "--no-progress", timeout=180)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("elastic-step train: error: cannot reach the object store for s3://data/digits")
    assert "AWS_ENDPOINT_URL" in lines[0] and closed in lines[0]
    assert not (tmp_path / "job" / "logs").exists()


def test_missing_bucket_and_missing_key(s3):
    with pytest.raises(DataError) as caught:
        load_manifest("s3://no-such-bucket/digits")
    assert str(caught.value).startswith("bucket 'no-such-bucket' does not exist (for s3://no-such-bucket/digits/manifest.json)")
    with pytest.raises(DataError) as caught:
        load_manifest(f"s3://{BUCKET}/not-prepared")
    assert str(caught.value).startswith(f"manifest not found: s3://{BUCKET}/not-prepared/manifest.json")


def test_missing_shard_in_s3_names_it(s3, digits):
    uri = f"s3://{BUCKET}/damaged"
    upload_folder(digits, uri)
    stores.resolve(uri)[0].rm(f"{BUCKET}/damaged/train/part-00001.parquet")
    with pytest.raises(DataError, match=f"shard not found: {uri}/train/part-00001.parquet"):
        validate_shards(load_manifest(uri))


def test_missing_bucket_cli_exits_2_with_one_line(s3, tmp_path):
    done = cli("train", "--model-def", SLOW_MODEL, "--data", "s3://no-such-bucket/digits", "--job-dir",
               str(tmp_path / "job"), "--no-progress", timeout=180)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "elastic-step train: error: bucket 'no-such-bucket' does not exist (for s3://no-such-bucket/digits/manifest.json) "
        "— check the bucket name, or create it at AWS_ENDPOINT_URL"]


@pytest.fixture(scope="module")
def s3_with_iam(digits):
    """An S3 server that checks credentials as AWS does: a known user without any policy, and
    a manifest only the (unchecked) setup could write."""
    import boto3

    server = S3Server(auth=True, free_actions=4).start()
    server.create_bucket("locked")
    server.client().put_object(Bucket="locked", Key="digits/manifest.json", Body=open(os.path.join(digits, "manifest.json"), "rb"))
    iam = boto3.client("iam", endpoint_url=server.endpoint, aws_access_key_id="setup", aws_secret_access_key="setup",
                       region_name="us-east-1")
    iam.create_user(UserName="no-policy")
    key = iam.create_access_key(UserName="no-policy")["AccessKey"]
    yield server, key["AccessKeyId"], key["SecretAccessKey"]
    server.stop()


@pytest.mark.parametrize("who", ["unknown key", "wrong secret", "no permission"])
def test_credentials_and_permissions(s3_with_iam, who, monkeypatch, tmp_path):
    server, key_id, secret = s3_with_iam
    key_id, secret, expected = {
        "unknown key": ("AKIAUNKNOWNKEY000000", "s3cr3t-value-unknown", "the object store rejected the credentials"),
        "wrong secret": (key_id, "s3cr3t-value-wrong", "the object store rejected the credentials"),
        "no permission": (key_id, secret, "permission denied"),
    }[who]
    for name, value in server.env(key_id, secret).items():
        monkeypatch.setenv(name, value)
    done = cli("train", "--model-def", SLOW_MODEL, "--data", "s3://locked/digits", "--job-dir", str(tmp_path / "job"),
               "--no-progress", timeout=180)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"elastic-step train: error: {expected} for s3://locked/digits/manifest.json")
    assert "AWS_ACCESS_KEY_ID" in lines[0]
    assert secret not in done.stderr + done.stdout


def test_store_error_never_repeats_a_secret_in_the_message():
    from botocore.exceptions import ClientError

    error = ClientError({"Error": {"Code": "SignatureDoesNotMatch", "Message": "signature for key s3cr3t"}}, "GetObject")
    for uri, exc in (("gs://b/k", PermissionError("s3cr3t")), ("s3://b/k", error),
                     ("s3://b/k", OSError("connection refused by s3cr3t"))):
        message = str(stores.store_error(uri, exc))
        assert uri in message and "s3cr3t" not in message and "\n" not in message


# -- KFP artifact URIs --------------------------------------------------------------------------

def test_kfp_artifact_uris(monkeypatch):
    """minio:// reads as s3://; the endpoint, when AWS_ENDPOINT_URL does not name one, is KFP's
    MinIO, returned as a storage option: this process's environment is left as it is."""
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    before = dict(os.environ)
    assert stores.kfp_artifact_uri_to_fsspec("s3://b/k") == ("s3://b/k", {})
    assert stores.kfp_artifact_uri_to_fsspec("gs://b/k") == ("gs://b/k", {})
    assert stores.kfp_artifact_uri_to_fsspec("/tmp/local/dataset") == ("/tmp/local/dataset", {})
    assert stores.kfp_artifact_uri_to_fsspec("minio://mlpipeline/v2/artifacts/p/r/dataset") == (
        "s3://mlpipeline/v2/artifacts/p/r/dataset", {"endpoint_url": "http://minio-service.kubeflow:9000"})
    assert stores.KFP_DEFAULT_MINIO_ENDPOINT == "http://minio-service.kubeflow:9000"
    assert dict(os.environ) == before
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://my-minio:9000")  # the user's own endpoint wins
    assert stores.kfp_artifact_uri_to_fsspec("minio://b/k") == ("s3://b/k", {})
    assert os.environ["AWS_ENDPOINT_URL"] == "http://my-minio:9000"
    # the train_elastic component: pods read the store URI, local workers the downloaded copy
    assert stores.artifact_data_uri("minio://b/k", "/minio/b/k", workers_share_filesystem=False) == ("s3://b/k", {})
    assert stores.artifact_data_uri("minio://b/k", "/minio/b/k", workers_share_filesystem=True) == ("/minio/b/k", {})
    assert stores.artifact_data_uri("/tmp/outputs/dataset", "/tmp/outputs/dataset", workers_share_filesystem=False) == (
        "/tmp/outputs/dataset", {})


def test_a_minio_artifact_uri_opens_the_s3_store(s3_digits, digits, monkeypatch):
    """The endpoint reaches the reader as a storage option, and the workers through worker_env."""
    monkeypatch.setattr(stores, "_applied", {})
    monkeypatch.setattr("fsspec.config.conf", {})
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.setattr(stores, "KFP_DEFAULT_MINIO_ENDPOINT", endpoint)  # the test's S3 server plays KFP's MinIO
    uri, options = stores.kfp_artifact_uri_to_fsspec("minio://" + s3_digits[len("s3://"):])
    assert (uri, options) == (s3_digits, {"endpoint_url": endpoint})
    fresh_filesystems()
    stores.set_storage_options(uri, options)
    assert "AWS_ENDPOINT_URL" not in os.environ
    assert load_manifest(uri).rows("train") == load_manifest(digits).rows("train")
    assert stores.worker_env()["FSSPEC_S3"] == json.dumps({"endpoint_url": endpoint})
    fresh_filesystems()


# -- the whole job in S3 ------------------------------------------------------------------------

@pytest.mark.e2e
def test_job_with_data_checkpoints_and_model_in_s3_survives_a_sigkilled_worker(s3, s3_digits, digits, start_job, tmp_path):
    """Also the SIGKILL of one of three workers mid-epoch, end to end (test_elastic_e2e.py's
    other losses): the group shrinks to 2, regroups without a state transfer, and grows back."""
    import re

    from mlflow.tracking import MlflowClient
    from mlflow_server import MlflowServer
    from test_elastic_e2e import state_transfers

    from elastic_step.audit import audit_report

    s3.create_bucket("mlflow")
    server = MlflowServer(str(tmp_path / "mlflow"), artifacts="s3://mlflow/artifacts")
    server.start()  # inherits the S3 environment: its artifact store is the S3 server
    try:
        job = start_job("--data", s3_digits, "--workers", "2:3", "--epochs", "6", "--model-def", SLOW_MODEL,
                        "--minibatch-size", "16", "--minibatches-per-task", "2", "--heartbeat-timeout", "4",
                        "--mlflow-uri", server.uri, "--experiment", "s3-data", "--checkpoint-steps", "40")
        # (a generous wait: on a busy machine starting the master and three workers alone takes minutes)
        status = job.wait_for(lambda s: s["world_size"] == 3 and 0.15 < s["rows_done"] / s["rows_total"] < 0.6, timeout=400)
        victim = job.kill_worker(status, rank=1)
        assert job.finish() == 0, job.output()

        report = audit_report(job.audit, s3_digits, epochs=6)
        assert report["exact"], report
        assert report["rows_applied"] == report["rows_expected"] == job.result()["rows_audited"]
        assert job.result()["test_metrics"]["accuracy"] >= 0.90  # what the same job reaches on local data
        events = job.events()
        died = [e for e in events if e["event"] == "died"]
        assert died and died[0]["worker"] == victim["id"] and "SIGKILL" in died[0]["reason"], died
        assert any(e["event"] == "recovered" for e in events)
        assert any(e["event"] == "relaunched" for e in events)
        assert "test: loss" in job.output() and "accuracy" in job.output()
        # A survivor that applied the source's steps is sent no state: a regroup sends it to a joiner
        # (the relaunched worker, if it joined before the job ended) or to one survivor left a step
        # behind, whose last collective failed where the other's had completed (the dead rank had
        # already sent that one its part: seen once in a full run), never to every member.
        transfers = state_transfers(job)
        assert transfers[1] == "[1, 2]", transfers
        later = [ranks for round_id, ranks in transfers.items() if round_id > 1]
        assert all(ranks == "none (every member holds it)" or re.fullmatch(r"\[\d\]", ranks) for ranks in later), transfers

        # checkpoints and the model went through the MLflow server into the bucket
        run_id = job.result()["run_id"]
        objects = stores.resolve("s3://mlflow")[0].find("mlflow/artifacts")
        assert any(f"/{run_id}/artifacts/checkpoints/step-" in o for o in objects), objects[:20]
        assert any(o.endswith(f"/{run_id}/artifacts/elastic_step_model/model.bin") for o in objects), objects[:20]
        assert any(o.endswith("/MLmodel") for o in objects), objects[:20]  # the logged MLflow model
        run = MlflowClient(server.uri).get_run(run_id)
        assert run.data.params["data"] == s3_digits
        assert not any(os.environ["AWS_SECRET_ACCESS_KEY"] in str(v) for v in run.data.params.values())
    finally:
        server.stop()


def test_a_shard_fetched_whole_decodes_only_the_row_groups_its_tasks_ask_for(s3_digits, digits, monkeypatch):
    """The shard's bytes came in one request (test above); decoding them is CPU the training
    shares, so a worker decodes the row groups of its own tasks, once each, exactly as it does
    from local disk, not the whole shard (the other workers' tasks) at its first task."""
    import pyarrow.parquet as pq

    calls: dict[int, list] = {}
    original = pq.ParquetFile.read_row_groups

    def spy(self, row_groups, *args, **kwargs):
        calls.setdefault(id(self), []).append(list(row_groups))
        return original(self, row_groups, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_groups", spy)
    remote, local = ShardReader(load_manifest(s3_digits)), ShardReader(load_manifest(digits))
    remote_file, local_file = remote._open("train", 0)[0], local._open("train", 0)[0]
    groups = remote_file.metadata.num_row_groups
    for start in (0, 100, 200, 0):
        np.testing.assert_array_equal(remote.read("train", 0, start, 50)["label"], local.read("train", 0, start, 50)["label"])
    decoded = calls[id(remote_file)]
    assert decoded == calls[id(local_file)], decoded
    assert all(len(c) < groups for c in decoded) and len(decoded) == 3, decoded  # the repeated range: cached
