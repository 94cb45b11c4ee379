"""Idle connections against a running job. Hundreds of sockets that never send a byte need no
token; the master once kept every one of them until uvicorn's connection limit was reached and
then answered 503 to its own workers, which were dropped as hung and relaunched until their
slots ran out. Now a connection that asks nothing is closed, one address holds at most a job's
worth of connections, and a worker that meets a busy master at registration waits instead of
exiting."""

from __future__ import annotations

import http.server
import json
import os
import selectors
import socket
import threading
import time
from urllib.parse import urlparse

import pytest

from elastic_step.operate.client import try_status
from elastic_step.worker.client import MasterClient

from conftest import SLOW_MODEL
from test_elastic_e2e import assert_exact

HEARTBEAT_TIMEOUT_S = 4.0
EPOCHS = 12


class IdleSockets:
    """`count` connections to `port` from `source` that never send a byte, each opened again as
    soon as the server closes it, until `stop()`. 127.0.0.2 is this machine too (all of 127/8 is
    loopback), but another host as the master sees it: the workers come from 127.0.0.1."""

    def __init__(self, port: int, count: int = 520, source: str = "127.0.0.2"):
        self.port, self.count, self.source = port, count, source
        self.opened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "IdleSockets":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _open(self, selector: selectors.BaseSelector) -> None:
        try:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=2, source_address=(self.source, 0))
        except OSError:
            return  # the backlog is full: try again on the next pass
        s.setblocking(False)
        selector.register(s, selectors.EVENT_READ)
        self.opened += 1

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        try:
            while not self._stop.is_set():
                while len(selector.get_map()) < self.count and not self._stop.is_set():
                    self._open(selector)
                for key, _ in selector.select(timeout=0.5):  # readable: the server closed it
                    selector.unregister(key.fileobj)
                    key.fileobj.close()
        finally:
            for key in list(selector.get_map().values()):
                key.fileobj.close()
            selector.close()


@pytest.mark.e2e
def test_a_job_under_520_idle_sockets_longer_than_its_heartbeat_timeout_ends_exact_without_relaunches(digits, start_job):
    job = start_job("--data", digits, "--workers", "2", "--epochs", str(EPOCHS), "--model-def", SLOW_MODEL,
                    "--minibatch-size", "16", "--minibatches-per-task", "2", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S))
    job.wait_for(lambda s: s["world_size"] == 2 and s["rows_done"] > 0, timeout=180)
    with open(os.path.join(job.job_dir, "master.json")) as f:
        port = urlparse(json.load(f)["url"]).port
    probes = []
    with IdleSockets(port) as attack:
        until = time.monotonic() + 2.5 * HEARTBEAT_TIMEOUT_S
        while time.monotonic() < until:
            probes.append(try_status(job.job_dir))  # the operator's CLI, from the workers' address
            time.sleep(0.5)
    assert all(p is not None for p in probes), f"{sum(p is None for p in probes)} of {len(probes)} status probes unanswered"
    assert probes[-1]["state"] == "running"  # the attack overlapped training from start to end
    assert job.finish() == 0, job.output()
    assert_exact(job, digits, epochs=EPOCHS)
    assert job.result()["relaunches"] == 0
    assert not [e for e in job.events() if e["event"] in ("died", "dropped", "relaunched")]
    assert attack.opened > 520, "the master closed the idle connections (those beyond an address's share at once)"
    # Its master has removed master.json: no address stays behind where a later listener would be
    # handed the token by `get` or `stop`; the final status says how the job ended.
    assert not os.path.exists(os.path.join(job.job_dir, "master.json"))
    with open(os.path.join(job.job_dir, "status.json")) as f:
        assert json.load(f)["state"] == "succeeded"


def test_a_worker_waits_out_a_busy_master_at_registration():
    """uvicorn answers 503 beyond its connection limit: a worker registering then keeps asking,
    with backoff, past its master timeout (which is for a master that does not answer at all)."""
    busy_until = time.monotonic() + 2.0
    asked = []

    class Master(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            asked.append(time.monotonic())
            busy = time.monotonic() < busy_until
            body = b'{"detail": "Service Unavailable"}' if busy else b'{"registered": true}'
            self.send_response(503 if busy else 200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Master)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = MasterClient(f"http://127.0.0.1:{server.server_address[1]}", "token", master_timeout_s=0.5)
        assert client.call("POST", "/register", {"worker_id": "w0.1"}) == {"registered": True}
        gaps = [b - a for a, b in zip(asked, asked[1:])]
        assert len(asked) < 20 and gaps[-1] > gaps[0], gaps  # backing off, not hammering
    finally:
        server.shutdown()
        server.server_close()
