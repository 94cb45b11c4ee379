"""A real `mlflow server` on 127.0.0.1 for tests: SQLite backend, served artifacts. It can be
stopped and started again on the same port and store (to test an outage).

With `auth=True` it runs MLflow's basic-auth app (`--app-name basic-auth`) the way
deploy/mlflow ships it: the auth settings are deploy/mlflow/auth-config.yaml's `basic_auth.ini`
with only the user store moved into the test's folder, and the admin user and password reach
the server through MLFLOW_AUTH_ADMIN_USERNAME/PASSWORD in its environment (the Secret
`mlflow-auth` in deploy/), never through a file or its command line. Every request but /health
then needs a user; `create_user` and `grant` are the admin's REST calls a platform engineer makes.
"""

from __future__ import annotations

import configparser
import contextlib
import io
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from elastic_step.tracking.sqlite_schema import seed_database
from processes import die_with_parent

AUTH_CONFIG = Path(__file__).resolve().parents[1] / "deploy" / "mlflow" / "auth-config.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shipped_auth_settings(user_store: str) -> str:
    """deploy/'s basic_auth.ini, its user store moved to `user_store` (a SQLAlchemy URI)."""
    config_map = yaml.safe_load(AUTH_CONFIG.read_text())
    parser = configparser.ConfigParser()
    parser.read_string(config_map["data"]["basic_auth.ini"])
    parser["mlflow"]["database_uri"] = user_store
    # Each request checks its password with PBKDF2, which takes seconds on a loaded test machine;
    # MLflow's own credential cache (per server process) keeps that to once a minute per user.
    parser["mlflow"]["auth_cache_ttl_seconds"] = "60"
    out = io.StringIO()
    parser.write(out)
    return out.getvalue()


class MlflowServer:
    def __init__(self, root: str, artifacts: str | None = None, auth: bool = False,
                 host: str = "127.0.0.1", allowed_hosts: list[str] | None = None, workspaces: bool = False):
        self.root = root
        self.artifacts = artifacts or os.path.join(root, "artifacts")  # a folder or a store URI (s3://...)
        self.host = host
        self.allowed_hosts = allowed_hosts  # MLflow's DNS-rebinding check; None keeps its default
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.db = f"sqlite:///{os.path.join(root, 'mlflow.db')}"
        self.proc: subprocess.Popen | None = None
        self.auth = auth
        self.workspaces = workspaces  # `--enable-workspaces`: experiments and models per workspace
        self.admin: tuple[str, str] | None = None
        if auth:
            self.admin = ("admin", secrets.token_urlsafe(18))
            self.auth_config = os.path.join(root, "basic_auth.ini")
            user_store = f"sqlite:///{os.path.join(root, 'basic_auth.db')}"
            Path(self.auth_config).write_text(shipped_auth_settings(user_store))
        # Create the schema once, before the server (and its workers) open the database: a copy of
        # the cached one, as a local job's database starts (else MLflow's own migrations).
        if not seed_database(os.path.join(root, "mlflow.db")):
            subprocess.run([sys.executable, "-m", "mlflow", "db", "upgrade", self.db], check=True, capture_output=True)

    def _command(self) -> list[str]:
        command = [sys.executable, "-m", "mlflow", "server", "--host", self.host, "--port", str(self.port),
                   "--backend-store-uri", self.db, "--artifacts-destination", self.artifacts, "--workers", "1"]
        if self.auth:
            command += ["--app-name", "basic-auth"]
        if self.workspaces:
            command.append("--enable-workspaces")
        if self.allowed_hosts:
            command += ["--allowed-hosts", ",".join(self.allowed_hosts)]
        return command

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
            env.pop(name, None)
        if self.auth:
            env.update(MLFLOW_AUTH_CONFIG_PATH=self.auth_config, MLFLOW_AUTH_ADMIN_USERNAME=self.admin[0],
                       MLFLOW_AUTH_ADMIN_PASSWORD=self.admin[1],
                       MLFLOW_FLASK_SERVER_SECRET_KEY=secrets.token_urlsafe(24))
        return env

    def start(self, timeout: float = 90.0) -> None:
        self.log = open(os.path.join(self.root, "server.log"), "a")
        self.proc = subprocess.Popen(self._command(), env=self._environment(),
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.uri + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: see {self.log.name}")
            time.sleep(0.3)
        raise RuntimeError("mlflow server did not become healthy")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.proc = None

    # --- the admin's side of basic auth -------------------------------------------------------

    def _as_admin(self, method: str, path: str, **kwargs) -> dict:
        assert self.admin is not None, "this server runs without auth"
        reply = httpx.request(method, self.uri + path, auth=self.admin, timeout=120, **kwargs)
        reply.raise_for_status()
        return reply.json() if reply.content else {}

    def create_user(self, username: str, password: str | None = None) -> str:
        """Create a user (not an admin) and return its password."""
        password = password or secrets.token_urlsafe(18)
        self._as_admin("POST", "/api/2.0/mlflow/users/create", json={"username": username, "password": password})
        return password

    def grant(self, username: str, resource_type: str, resource_id: str, permission: str) -> None:
        """Give `username` READ/USE/EDIT/MANAGE on one experiment ("experiment", its id) or
        registered model ("registered_model", its name); "*" grants it on all of that type."""
        self._as_admin("POST", "/api/3.0/mlflow/users/permissions/grant",
                       json={"username": username, "resource_type": resource_type,
                             "resource_id": resource_id, "permission": permission})

    def credentials_env(self, username: str, password: str) -> dict[str, str]:
        """What a client needs to reach this server as `username` (MLflow reads these)."""
        return {"MLFLOW_TRACKING_URI": self.uri, "MLFLOW_TRACKING_USERNAME": username,
                "MLFLOW_TRACKING_PASSWORD": password}


PIPELINES_USER = "pipelines"  # the pipelines' own MLflow user (docs/kubernetes.md)


@contextlib.contextmanager
def pipelines_server(folder: str):
    """MLflow behind basic auth, as deploy/mlflow ships it, with the pipelines' own user: its
    password in `pipelines_password`. Stopped on leaving."""
    server = MlflowServer(folder, auth=True)
    server.start(timeout=240)  # its auth app's first start migrates a user store: slow on a busy machine
    try:
        server.pipelines_password = server.create_user(PIPELINES_USER)
        yield server
    finally:
        server.stop()
