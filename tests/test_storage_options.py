"""Storage options travel as plain values in worker environments and pod specs, so a job takes
only those that say where a store is and how to reach it (an allow-list): whatever else could
carry a credential, however it is named or nested, is refused before it is applied anywhere."""

import json

import pytest

from elastic_step.data import stores
from elastic_step.errors import ConfigError

from conftest import cli


@pytest.fixture(autouse=True)
def nothing_applied(monkeypatch):
    monkeypatch.setattr(stores, "_applied", {})
    monkeypatch.setattr("fsspec.config.conf", {})


@pytest.mark.parametrize("option", [
    'client_kwargs={"headers": {"Authorization": "Bearer s3cr3t-value"}}',  # s3fs hands it to botocore as is
    'config_kwargs={"proxies": {"https": "http://u:s3cr3t-value@proxy:3128"}}',
    's3_additional_kwargs={"SSECustomerKey": "s3cr3t-value"}',
    'client_kwargs={"region_name": {"nested": "s3cr3t-value"}}',
    'endpoint_url={"a": "s3cr3t-value"}',
    "profile=s3cr3t-value",
])
def test_an_option_outside_the_allow_list_is_refused_without_its_value(option):
    with pytest.raises(ConfigError) as caught:
        stores.set_storage_options("s3://bucket/data", dict([stores.parse_storage_option(option)]))
    message = str(caught.value)
    assert "s3cr3t-value" not in message and "\n" not in message
    assert not [k for k in stores.worker_env() if k.startswith("FSSPEC_")]
    assert "s3" not in __import__("fsspec").config.conf


def test_the_options_that_say_where_a_store_is_reach_workers():
    options = {"endpoint_url": "http://minio:9000", "anon": False, "client_kwargs": {"region_name": "eu-west-1", "verify": False},
               "config_kwargs": {"s3": {"addressing_style": "path"}, "retries": {"max_attempts": 3}}}
    stores.set_storage_options("s3://bucket/data", options)
    assert json.loads(stores.worker_env()["FSSPEC_S3"]) == options
    stores.set_storage_options("gs://bucket/data", {"project": "p", "requester_pays": True})
    assert json.loads(stores.worker_env()["FSSPEC_GS"]) == {"project": "p", "requester_pays": True}


def test_train_refuses_an_authorization_header_before_anything_starts(tmp_path):
    done = cli("train", "--model-def", "elastic_step.model_zoo.digits_torch", "--data", "s3://bucket/data",
               "--job-dir", str(tmp_path / "job"), "--storage-option",
               'client_kwargs={"headers": {"Authorization": "Bearer do-not-print-me"}}', timeout=120)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert "client_kwargs.headers" in done.stderr and "do-not-print-me" not in done.stderr + done.stdout
    assert not (tmp_path / "job").exists()
