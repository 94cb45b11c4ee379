"""`elastic-step serve`: a registered version behind MLflow's own model server on 127.0.0.1,
answering /invocations with the registered model's predictions; bad input refused in one line
before any server starts."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import httpx
import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from registered_models import make_store, predict, register_linear, rows

NAME = "serve-test"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    uri = make_store(str(tmp_path_factory.mktemp("registry")))
    v1 = register_linear(uri, NAME, seed=1)
    v2 = register_linear(uri, NAME, seed=2)
    unsigned = register_linear(uri, NAME, seed=3, signature=False)
    MlflowClient(uri).set_registered_model_alias(NAME, "champion", v2)
    return {"uri": uri, "v1": v1, "v2": v2, "unsigned": unsigned}


def test_serve_answers_with_the_champion_versions_predictions(store, tmp_path):
    env = {**os.environ, "MLFLOW_TRACKING_URI": store["uri"]}
    proc = subprocess.Popen([sys.executable, "-m", "elastic_step.cli", "serve", f"models:/{NAME}@champion", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=open(tmp_path / "server.log", "w"), text=True, env=env,
                            cwd=tmp_path, start_new_session=True)
    try:
        line = proc.stdout.readline()  # printed once /ping answered
        m = re.match(r"serving models:/(?P<name>[^/]+)/(?P<version>\d+) \(run \w+\) at (?P<url>http://127\.0\.0\.1:\d+)", line)
        assert m, f"{line!r}; server log: {(tmp_path / 'server.log').read_text()[-2000:]}"
        assert m["version"] == store["v2"]  # the alias, resolved to the exact version
        url = m["url"]
        assert httpx.get(f"{url}/ping", timeout=10).status_code == 200
        data = rows(6)
        answer = httpx.post(f"{url}/invocations", json={"inputs": data.tolist()}, timeout=30)
        assert answer.status_code == 200, answer.text
        served = np.asarray(answer.json()["predictions"], dtype=np.float32)
        np.testing.assert_allclose(served, predict(store["uri"], f"models:/{NAME}/{store['v2']}", data), rtol=1e-5, atol=1e-6)
        # ... and not the other version's
        assert not np.allclose(served, predict(store["uri"], f"models:/{NAME}/{store['v1']}", data))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(30) == 0  # SIGTERM stops the server and the command, cleanly
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/ping", timeout=2)


@pytest.mark.parametrize("model, says", [
    (f"models:/{NAME}@nope", f"registered model '{NAME}' has no alias @nope; pass an alias it has (@champion)"),
    (f"models:/{NAME}/99", f"registered model '{NAME}' has no version '99'"),
    ("models:/not-registered@champion", "has no alias @champion; pass an alias it has (the model is not registered)"),
    (f"runs:/abc/model", "is not models:/NAME@ALIAS or models:/NAME/VERSION"),
])
def test_serve_refuses_what_it_cannot_resolve_in_one_line(store, model, says, capsys):
    from elastic_step.cli import main

    assert main(["serve", model, "--port", "0", "--mlflow-uri", store["uri"]]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err


def test_serve_refuses_a_version_without_a_signature(store, capsys):
    from elastic_step.cli import main

    assert main(["serve", f"models:/{NAME}/{store['unsigned']}", "--port", "0", "--mlflow-uri", store["uri"]]) == 2
    err = capsys.readouterr().err.strip()
    assert f"version {store['unsigned']} of '{NAME}' has no signature" in err and "\n" not in err


def test_serve_refuses_a_busy_port(store, capsys):
    import socket

    from elastic_step.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", f"models:/{NAME}@champion", "--port", str(port), "--mlflow-uri", store["uri"]]) == 2
    assert f"--port {port}: cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
