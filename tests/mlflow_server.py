"""A real `mlflow server` on 127.0.0.1 for tests: SQLite backend, served artifacts. It can be
stopped and started again on the same port and store (to test an outage)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    def __init__(self, root: str, artifacts: str | None = None):
        self.root = root
        self.artifacts = artifacts or os.path.join(root, "artifacts")  # a folder or a store URI (s3://...)
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.db = f"sqlite:///{os.path.join(root, 'mlflow.db')}"
        self.proc: subprocess.Popen | None = None
        # Create the schema once, before the server (and its workers) open the database.
        subprocess.run([sys.executable, "-m", "mlflow", "db", "upgrade", self.db], check=True, capture_output=True)

    def start(self, timeout: float = 90.0) -> None:
        self.log = open(os.path.join(self.root, "server.log"), "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--backend-store-uri", self.db, "--artifacts-destination", self.artifacts,
             "--workers", "1"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )
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
