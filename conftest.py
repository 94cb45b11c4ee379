"""Fixtures for every test folder."""

from __future__ import annotations

import os

import pytest

_AT_START = {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")}


@pytest.fixture(autouse=True)
def _mlflow_env_restored():
    """`mlflow.set_tracking_uri` also sets MLFLOW_TRACKING_URI in os.environ, so a test (or a
    module's fixture) that calls it in-process would hand its store to every job a later test
    starts as a subprocess (which then logs to the wrong place). After each test the MLflow
    variables are as they were when the session began (the engine's own calls leave them alone:
    elastic_step.tracking.uri.use_tracking_uri)."""
    yield
    for key in [k for k in os.environ if k.startswith("MLFLOW_") and k not in _AT_START]:
        del os.environ[key]
    os.environ.update(_AT_START)
