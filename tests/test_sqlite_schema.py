"""A local job's SQLite tracking database starts as a copy of MLflow's schema built once per
MLflow release: the copy must be the database MLflow itself would have made (same tables, same
schema revision, the default experiment at this store's artifact root), it must never replace a
database that exists, and a cache that cannot be written must cost only time."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys

import pytest

from elastic_step.tracking.run import connect
from elastic_step.tracking.sqlite_schema import CACHE_ENV, schema_copy_path, seed_database


def schema_of(db: str) -> tuple[set[str], list[tuple]]:
    """The names of its tables, indexes and triggers, and its schema revision."""
    with sqlite3.connect(db) as connection:
        names = {name for (name,) in connection.execute("SELECT name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'")}
        revision = connection.execute("SELECT version_num FROM alembic_version").fetchall()
    connection.close()
    return names, revision


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_seeded_database_is_the_one_mlflow_makes_and_takes_runs(tmp_path, cache):
    # MLflow's own fresh store, made as a job without the cache makes it: in a new process (which
    # tables SQLAlchemy creates depends on the models a process has imported).
    mlflow_made = str(tmp_path / "plain" / "mlflow.db")
    os.makedirs(os.path.dirname(mlflow_made))
    subprocess.run([sys.executable, "-c", "import sys; from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore; "
                    "SqlAlchemyStore(sys.argv[1], sys.argv[2])", f"sqlite:///{mlflow_made}", str(tmp_path / "plain" / "a")],
                   check=True, capture_output=True)

    client = connect(f"sqlite:///{tmp_path / 'job' / 'mlflow.db'}", str(tmp_path / "job"))
    assert os.path.exists(schema_copy_path())  # built on the first job, kept for the next
    seeded, plain = schema_of(str(tmp_path / "job" / "mlflow.db")), schema_of(mlflow_made)
    assert seeded[1] == plain[1]  # the same schema revision: MLflow's head
    assert plain[0] <= seeded[0], sorted(plain[0] - seeded[0])  # every table, index and trigger MLflow makes
    (default,) = client.search_experiments()
    assert default.name == "Default" and "cache" not in default.artifact_location  # not the scratch build's path
    experiment = client.create_experiment("digits", artifact_location=str(tmp_path / "job" / "mlartifacts"))
    run = client.create_run(experiment)
    client.log_metric(run.info.run_id, "loss", 0.5, step=1)
    assert client.get_metric_history(run.info.run_id, "loss")[0].value == 0.5

    # The second job copies the cached schema; its database holds nothing of the first's.
    second = connect(f"sqlite:///{tmp_path / 'job2' / 'mlflow.db'}", str(tmp_path / "job2"))
    assert [e.name for e in second.search_experiments()] == ["Default"]


def test_an_existing_database_is_never_replaced(tmp_path, cache):
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"a run's history")
    assert seed_database(str(db)) is False
    assert db.read_bytes() == b"a run's history"


def test_a_cache_that_cannot_be_written_leaves_the_schema_to_mlflow(tmp_path, monkeypatch):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocked))
    assert seed_database(str(tmp_path / "job" / "mlflow.db")) is False
    assert not (tmp_path / "job" / "mlflow.db").exists()
    client = connect(f"sqlite:///{tmp_path / 'job' / 'mlflow.db'}", str(tmp_path / "job"))
    assert [e.name for e in client.search_experiments()] == ["Default"]
