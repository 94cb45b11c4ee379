"""The live page of a job on Kubernetes, served on this machine's loopback (`elastic-step ui
--backend kubernetes`): the master's own page cannot be reached from outside its job (its
NetworkPolicy admits only the job's workers), so the same page is fed here from the status the
master publishes to its ConfigMap, read with the caller's own credentials.

The page's data routes need a token this server makes up when it starts (printed in the page's
address, after `#`, which a browser never sends): another user of the machine who finds the
port gets the empty page and nothing else."""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from elastic_step.errors import ElasticStepError
from elastic_step.master.ui_page import PAGE, PAGE_HEADERS
from elastic_step.protocol import API, UI_PAGE, Route

log = logging.getLogger("elastic_step.operate.pageserver")

READ_EVERY_S = 1.0  # the page asks every 2 s, three routes at a time: one read of the ConfigMap serves them


class PublishedStatus:
    """The job's newest published document, read at most once a second; the last one seen is
    kept (its state marked) once the job's ConfigMap is gone."""

    def __init__(self, read):
        self.read = read  # () -> the document, or None when the job has none any more
        self.document: dict | None = None
        self.read_at = 0.0
        self.lock = threading.Lock()

    def current(self) -> dict:
        with self.lock:
            if time.monotonic() - self.read_at >= READ_EVERY_S:
                self.read_at = time.monotonic()
                try:
                    found = self.read()
                except ElasticStepError as exc:  # the API does not answer now: the page shows the last state
                    log.warning("%s", exc)
                    found = self.document
                if found is None and self.document is not None and self.document["status"].get("state") == "running":
                    self.document["status"]["state"] = "ended"  # its master deleted the status with the job
                self.document = found or self.document
            if self.document is None:
                raise ElasticStepError("the job has published no status")
            return self.document


class PageServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, source: PublishedStatus, port: int = 0):
        # Loopback only: the page is for the person at this machine.
        super().__init__(("127.0.0.1", port), PageRequest)
        self.source = source
        self.token = secrets.token_urlsafe(24)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{UI_PAGE}#token={self.token}"


class PageRequest(BaseHTTPRequestHandler):
    server: PageServer

    def log_message(self, format, *args):  # no access log: the console is the person's
        pass

    def do_GET(self):
        parsed = urllib.parse.urlsplit(self.path)
        if parsed.path == UI_PAGE:
            return self._send(200, PAGE.encode(), "text/html; charset=utf-8", PAGE_HEADERS)
        given = self.headers.get("Authorization") or ""
        if not hmac.compare_digest(given.encode(), f"Bearer {self.server.token}".encode()):
            return self._json(401, {"detail": "missing or wrong token: open the address `elastic-step ui` printed"})
        try:
            document = self.server.source.current()
        except ElasticStepError as exc:
            return self._json(503, {"detail": str(exc)})
        route = parsed.path[len(API):] if parsed.path.startswith(API) else None
        if route == Route.STATUS:
            return self._json(200, document["status"])
        if route == Route.HISTORY:
            return self._json(200, {"steps": document.get("history", [])})
        if route == Route.EVENTS:
            events = document.get("events", [])
            total = document.get("events_next", len(events))
            try:
                since = int(urllib.parse.parse_qs(parsed.query).get("since", ["0"])[-1])
            except ValueError:
                return self._json(422, {"detail": "since: a whole number"})
            first = total - len(events)  # the index of the oldest published event
            return self._json(200, {"events": events[max(since - first, 0):], "next": total})
        return self._json(404, {"detail": "Not Found"})

    def _json(self, code: int, body: dict) -> None:
        self._send(code, json.dumps(body, default=str).encode(), "application/json", {"Cache-Control": "no-store"})

    def _send(self, code: int, body: bytes, content_type: str, headers: dict) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)
