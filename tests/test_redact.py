"""Tracking URIs lose their secrets wherever they are shown (parameters, logs, errors, result
files): the password of the user's part, however it is written, and secret query parameters."""

import pytest

from elastic_step.tracking.uri import redact


@pytest.mark.parametrize("uri,shown,secret", [
    ("postgresql://u:pa/ss@db/mlflow", "postgresql://u:***@db/mlflow", "pa/ss"),  # '/' in the password
    ("postgresql://u:p@ss@h/db", "postgresql://u:***@h/db", "p@ss"),  # '@' in it: the user's part ends at the last '@'
    ("mysql://u:p?ss#w@h/db", "mysql://u:***@h/db", "p?ss#w"),  # '?' and '#' in it
    ("http://h:5000/?password=hunter2&x=1", "http://h:5000/?password=***&x=1", "hunter2"),
    ("https://mlflow/api?access_token=abc123", "https://mlflow/api?access_token=***", "abc123"),
    ("s3://b/k?X-Amz-Signature=f00d&X-Amz-Date=1", "s3://b/k?X-Amz-Signature=***&X-Amz-Date=1", "f00d"),
    ("http://alice:hunter2@mlflow:5000", "http://alice:***@mlflow:5000", "hunter2"),
    ("https://ghp_t0ken@host/x", "https://***@host/x", "ghp_t0ken"),  # a user name alone may be a token
])
def test_a_uri_loses_its_password_however_it_is_written(uri, shown, secret):
    assert redact(uri) == shown
    said = redact(f"cannot reach MLflow at {uri} (connection refused); also tried '{uri}'")
    assert secret not in said and said.count(shown) == 2


@pytest.mark.parametrize("text", ["sqlite:///jobs/mlflow.db", "http://host/p?next=a@b&page=2", "models:/digits@champion",
                                  "file:///tmp/mlruns", "http://h/?token=&a=b", "", "no uri here"])
def test_what_holds_no_secret_is_left_as_it_is(text):
    assert redact(text) == text
