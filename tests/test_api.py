"""The master API: the bearer token guards every route, malformed bodies get 422, never 500."""

import pytest
from fastapi.testclient import TestClient

from elastic_step.master.api import create_app
from elastic_step.protocol import this_engine

from test_master_state import make_state

TOKEN = "s3cret-token"


@pytest.fixture
def app_state():
    state, backend = make_state()
    return TestClient(create_app(state, TOKEN)), state


AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}])
def test_missing_or_wrong_token_is_401_and_changes_nothing(app_state, headers):
    client, state = app_state
    before = state.status()
    for method, path, body in [("post", "/v1/scale", {"workers": 2}), ("post", "/v1/task", {"worker_id": "w0.1", "round_id": 1}),
                               ("post", "/v1/fail", {"worker_id": "w0.1", "reason": "x"}), ("get", "/v1/status", None),
                               ("post", "/v1/scale", "not json at all")]:
        response = getattr(client, method)(path, headers=headers, **({"json": body} if body is not None else {}))
        assert response.status_code == 401, (path, response.text)
    assert state.status() == before
    assert state.target == 3 and state.state == "running"


@pytest.mark.parametrize("path,body", [
    ("/v1/scale", {"workers": "many"}),
    ("/v1/scale", {}),
    ("/v1/steps", {"worker_id": "w0.1", "round_id": 1, "steps": [{"step": 0}]}),
    ("/v1/rendezvous", {"worker_id": "w0.1", "step": -5}),
    ("/v1/heartbeat", ["not", "an", "object"]),
])
def test_malformed_bodies_are_422(app_state, path, body):
    client, state = app_state
    response = client.post(path, headers=AUTH, json=body)
    assert response.status_code == 422, response.text


def test_unparseable_json_is_422(app_state):
    client, _ = app_state
    response = client.post("/v1/task", headers={**AUTH, "Content-Type": "application/json"}, content=b"{oops")
    assert response.status_code == 422


def test_scale_outside_the_job_range_is_refused_with_the_range(app_state):
    client, state = app_state
    response = client.post("/v1/scale", headers=AUTH, json={"workers": 7})
    assert response.status_code == 409 and "2:3" in response.text
    assert state.target == 3


def test_unknown_worker_cannot_register(app_state):
    client, _ = app_state
    response = client.post("/v1/register", headers=AUTH, json={"worker_id": "intruder"})
    assert response.status_code == 409


def relaunched(state) -> str:
    """A worker launched and not registered yet: w0.1's relaunch, after w0.1 was killed."""
    from elastic_step.backends.api import WorkerExit

    state.backend.exits.append(WorkerExit("w0.1", "killed by SIGKILL", -9))
    state.tick()
    return "w0.2"


def test_a_worker_of_another_engine_is_refused_and_fails_the_job_naming_both(app_state):
    client, state = app_state
    worker = relaunched(state)
    other = this_engine().model_copy(update={"release": "0.0.9"})
    response = client.post("/v1/register", headers=AUTH, json={"worker_id": worker, "engine": other.model_dump()})
    assert response.status_code == 409, response.text
    detail = response.json()["detail"]
    assert f"worker {worker} runs elastic-step 0.0.9 (protocol {other.protocol}), its master runs {this_engine()}" in detail
    assert "--image" in detail and len(detail.splitlines()) == 1
    assert state.state == "failed" and state.failure == detail  # every slot would meet the same image


def test_a_worker_that_does_not_say_its_engine_is_refused(app_state):
    client, state = app_state
    response = client.post("/v1/register", headers=AUTH, json={"worker_id": relaunched(state)})
    assert response.status_code == 409 and "does not say which" in response.text, response.text
    assert state.state == "failed"


def test_only_a_worker_the_master_launched_can_fail_the_job_by_its_engine(app_state):
    client, state = app_state
    other = this_engine().model_copy(update={"protocol": "0" * 12})
    response = client.post("/v1/register", headers=AUTH, json={"worker_id": "intruder", "engine": other.model_dump()})
    assert response.status_code == 409 and "not launched by this master" in response.text
    assert state.state == "running"
    same = client.post("/v1/register", headers=AUTH, json={"worker_id": relaunched(state), "engine": this_engine().model_dump()})
    assert same.status_code == 200 and same.json()["job_name"]


def test_status_with_the_token(app_state):
    client, _ = app_state
    status = client.get("/v1/status", headers=AUTH).json()
    assert status["state"] == "running" and len(status["workers"]) == 3
