"""Fixtures for every test folder."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _mlflow_env_restored():
    """`mlflow.set_tracking_uri` also sets MLFLOW_TRACKING_URI in os.environ, so a test that calls
    it in-process would hand its store to every job a later test starts as a subprocess (which
    then logs to the wrong place). Each test gets back the MLflow variables it started with."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")}
    yield
    for key in [k for k in os.environ if k.startswith("MLFLOW_") and k not in saved]:
        del os.environ[key]
    os.environ.update(saved)
