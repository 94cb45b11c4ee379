"""`elastic-step serve`: one registered version on 127.0.0.1 with MLflow's own model server
(`mlflow models serve --env-manager local`), the same server the `mlflow` deploy target runs in
a pod. The alias is resolved once, before the server starts: the server holds that version even
if the alias moves while it runs."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from elastic_step.errors import ConfigError, JobFailed
from elastic_step.release.served_model import ServedModel, parse_model_uri, resolve

HOST = "127.0.0.1"  # a laptop's server answers this machine only


@dataclass
class LocalServer:
    model: ServedModel
    url: str
    process: subprocess.Popen

    def stop(self, grace: float = 10.0) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def server_command(model: ServedModel, host: str, port: int | str) -> list[str]:
    """`mlflow models serve` of the exact version (never the alias) with this environment."""
    return [sys.executable, "-m", "mlflow", "models", "serve", "-m", model.model_uri, "--env-manager", "local",
            "-h", host, "-p", str(port)]


def start(model_ref: str, port: int = 0, mlflow_uri: str | None = None, ready_timeout: float = 120.0,
          log=None) -> LocalServer:
    """Resolve `model_ref`, start its server and return once /ping answers. Port 0: a free one."""
    name, ref = parse_model_uri(model_ref)
    model = resolve(name, ref, mlflow_uri)
    port = _free_port(port)
    env = dict(os.environ)
    # mlflow runs `uvicorn` by name: this interpreter's scripts first, activated or not
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    if mlflow_uri:
        env["MLFLOW_TRACKING_URI"] = mlflow_uri  # in the environment: it may hold a password
    # The server's own output (its access log too) goes to stderr or `log`: stdout is the URL line.
    process = subprocess.Popen(server_command(model, HOST, port), env=env, stdout=log or sys.stderr,
                               stderr=subprocess.STDOUT, start_new_session=True)
    server = LocalServer(model, f"http://{HOST}:{port}", process)
    try:
        _wait_ready(server, ready_timeout)
    except BaseException:
        server.stop()
        raise
    return server


def _free_port(port: int) -> int:
    """`port` if it can be bound on HOST (0: any free one), checked before the server starts so
    that a busy port is one line here, not a traceback from the server."""
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError as exc:
            raise ConfigError(f"--port {port}: cannot listen on {HOST}:{port} ({exc.strerror}); pick a free port "
                              "or 0 for any") from None
        return s.getsockname()[1]


def _wait_ready(server: LocalServer, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise JobFailed(f"the model server of {server.model.model_uri} exited with code {server.process.returncode} "
                            "before answering /ping; its output above says why")
        try:
            if httpx.get(server.url + "/ping", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise JobFailed(f"the model server of {server.model.model_uri} did not answer /ping within {timeout:.0f}s")


def serve_forever(server: LocalServer, grace: float = 10.0) -> int:
    """Wait on the server; SIGTERM or Ctrl-C stops it (SIGKILL after `grace` seconds). Returns 0
    when it was stopped, else the server's own exit code. The handler only signals: waiting for
    the child inside a handler would race the main thread's wait."""
    stop_asked: list[float] = []

    def stop(signum, frame):
        if not stop_asked and server.process.poll() is None:
            os.killpg(server.process.pid, signal.SIGTERM)
        stop_asked.append(time.monotonic())

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        try:
            code = server.process.wait(timeout=0.5)
            return 0 if stop_asked else code
        except subprocess.TimeoutExpired:
            if stop_asked and time.monotonic() - stop_asked[0] > grace:
                os.killpg(server.process.pid, signal.SIGKILL)
