"""MLflow behind basic auth, as deploy/mlflow ships it (tests/mlflow_server.py with auth=True):
a request without a user is refused, a user's request is served, and a user reads but cannot
write another user's experiment (deploy/'s default_permission is READ)."""

from __future__ import annotations

import httpx
import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from mlflow_server import MlflowServer


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    server = MlflowServer(str(tmp_path_factory.mktemp("mlflow-auth")), auth=True)
    server.start()
    yield server
    server.stop()


def _client_as(monkeypatch, server: MlflowServer, username: str, password: str) -> MlflowClient:
    for name, value in server.credentials_env(username, password).items():
        monkeypatch.setenv(name, value)
    return MlflowClient(server.uri)


def test_a_request_without_a_user_is_refused_and_a_users_request_is_served(auth_server, monkeypatch):
    search = auth_server.uri + "/api/2.0/mlflow/experiments/search"
    http = httpx.Client(timeout=120)  # a password check is PBKDF2: seconds on a loaded machine
    assert http.post(search, json={"max_results": 10}).status_code == 401
    assert http.get(auth_server.uri + "/health").status_code == 200  # the probe stays open

    password = auth_server.create_user("pipeline")
    assert http.post(search, json={"max_results": 10}, auth=("pipeline", "wrong")).status_code == 401
    assert http.post(search, json={"max_results": 10}, auth=("pipeline", password)).status_code == 200

    client = _client_as(monkeypatch, auth_server, "pipeline", password)
    experiment = client.create_experiment("authed")
    run = client.create_run(experiment)
    client.log_metric(run.info.run_id, "loss", 0.5)
    assert client.get_run(run.info.run_id).data.metrics == {"loss": 0.5}


def test_another_user_reads_but_cannot_write_until_granted(auth_server, monkeypatch):
    owner = _client_as(monkeypatch, auth_server, "owner", auth_server.create_user("owner"))
    experiment = owner.create_experiment("owned")
    run = owner.create_run(experiment).info.run_id

    password = auth_server.create_user("reader")
    reader = _client_as(monkeypatch, auth_server, "reader", password)
    assert reader.get_run(run).info.experiment_id == experiment
    with pytest.raises(MlflowException, match="PERMISSION_DENIED|Permission denied|403"):
        reader.log_metric(run, "loss", 1.0)

    auth_server.grant("reader", "experiment", experiment, "EDIT")
    reader.log_metric(run, "loss", 1.0)
    assert owner.get_run(run).data.metrics == {"loss": 1.0}
