"""A job's own SQLite tracking database, started from a copy of MLflow's schema.

MLflow makes a fresh SQLite store by running every one of its schema migrations, which takes
longer than opening an existing store (about 1 s more on a quiet 2-core machine, 4 s more when
the cores are busy), and every local job pays it before it trains. The schema is the same for
every job of one MLflow release, so it is built once per release into the user's cache and each
new job's database starts as a copy of it. The copy holds no experiment: MLflow adds its default
experiment, with this store's artifact root, when it first opens the copy.

Any trouble with the cache (no writable home in a container, a damaged copy) only costs the
time it was meant to save: MLflow then builds the schema itself, as it always did.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile

log = logging.getLogger("elastic_step.tracking")

CACHE_ENV = "ELASTIC_STEP_CACHE_DIR"  # where the schema copy is kept (default: $XDG_CACHE_HOME/elastic-step)


def cache_dir() -> str:
    given = os.environ.get(CACHE_ENV)
    if given:
        return given
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "elastic-step")


def schema_copy_path() -> str:
    import mlflow

    return os.path.join(cache_dir(), f"mlflow-{mlflow.__version__}-sqlite-schema.db")


def seed_database(db_path: str) -> bool:
    """Start a database that does not exist yet as a copy of MLflow's empty schema (made first if
    the cache has none). Whether it was seeded; False leaves `db_path` untouched for MLflow."""
    if os.path.exists(db_path):
        return False
    try:
        schema = schema_copy_path()
        if not os.path.exists(schema):
            build_schema(schema)
        staged = f"{db_path}.seed-{os.getpid()}"
        shutil.copyfile(schema, staged)
        try:
            os.link(staged, db_path)  # never over a database another process made meanwhile
        except FileExistsError:
            pass
        finally:
            os.unlink(staged)
        return True
    except (OSError, sqlite3.Error) as exc:
        log.info("tracking: MLflow builds this job's database schema itself (no cached copy: %s)", exc)
        return False


def build_schema(schema: str) -> None:
    """MLflow's schema of this release, made by MLflow's own `mlflow db upgrade` in a scratch
    database, in a process of its own (the tables SQLAlchemy creates depend on which of MLflow's
    models a process has imported), with any experiment taken out; published atomically."""
    os.makedirs(os.path.dirname(schema), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(schema)) as scratch:
        db = os.path.join(scratch, "schema.db")
        made = subprocess.run([sys.executable, "-m", "mlflow", "db", "upgrade", f"sqlite:///{db}"],
                              capture_output=True, text=True, timeout=300)
        if made.returncode != 0:
            raise OSError(f"mlflow db upgrade failed: {made.stderr.strip()[-300:]}")
        with sqlite3.connect(db) as connection:  # an experiment would hold this scratch folder's path
            for (table,) in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE 'experiment%'"):
                connection.execute(f'DELETE FROM "{table}"')
        connection.close()
        os.replace(db, schema)
