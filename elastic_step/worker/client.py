"""The worker's side of the master API (httpx). A master is gone, and the worker exits on its own
so that a dead master leaves no workers, when
- its address refuses connections for `refused_grace_s` (a few seconds): nothing listens there any
  more, the master process died; or
- it does not answer for `master_timeout_s`: a network partition may heal, so it gets that long.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time

import httpx

from elastic_step import defaults
from elastic_step.protocol import API, Route, WorkerEnv

log = logging.getLogger("elastic_step.worker")


class MasterGone(Exception):
    pass


class Rejected(Exception):
    """The master answered, and said no (4xx)."""

    def __init__(self, status: int, body: str):
        super().__init__(f"{status}: {body}")
        self.status = status
        try:  # the master's refusals are {"detail": "..."}
            self.detail = str(json.loads(body)["detail"])
        except (ValueError, KeyError, TypeError):
            self.detail = body


REQUEST_TIMEOUT_S = 10.0


def refused(exc: BaseException) -> bool:
    """True when `exc` says the address actively refused the connection (nothing listens)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ConnectionRefusedError) or getattr(exc, "errno", None) == errno.ECONNREFUSED:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class _Patience:
    """One call's retry state: its deadline, since when the master's address has refused, and the
    pause before the next attempt. A master may come back (a partition heals, a busy master frees
    a connection), so a call keeps asking until it is clear that it will not."""

    def __init__(self, url: str, master_timeout_s: float, refused_grace_s: float):
        self.url = url
        self.master_timeout_s = master_timeout_s
        self.refused_grace_s = refused_grace_s
        self.deadline = time.monotonic() + master_timeout_s
        self.refused_since: float | None = None
        self.delay = 0.05

    def attempt_timeout(self, timeout: float | None) -> float:
        # No ordinary attempt outlives the deadline: a master that does not answer at all is
        # given master_timeout_s in total, not that plus a request timeout. (A call with its
        # own timeout is a long poll the master may hold; the heartbeat watches meanwhile.)
        if timeout is not None:
            return timeout
        return min(REQUEST_TIMEOUT_S, max(self.deadline - time.monotonic(), 0.1))

    def wait_after_transport_error(self, exc: httpx.TransportError) -> None:
        """Sleep before the next attempt, or raise MasterGone: once the address has refused for
        the grace period (nothing listens there), or once the deadline has passed."""
        now = time.monotonic()
        self._note_refusal(exc, now)
        if now > self.deadline:
            raise MasterGone(f"master at {self.url} unreachable for {self.master_timeout_s:.0f}s: {exc}") from exc
        time.sleep(min(self.delay, max(self.deadline - now, 0.0) + 0.01))
        # Pauses double; while the address refuses they stay at most 0.5 s, so that its few
        # seconds of grace are a series of tries, not one or two.
        self.delay = min(self.delay * 2, 0.5 if self.refused_since is not None else 1.0)

    def _note_refusal(self, exc: httpx.TransportError, now: float) -> None:
        """Refusals must come one after another for the grace period: any other error (a timeout,
        say) means something listens, and the count starts again."""
        if not refused(exc):
            self.refused_since = None
            return
        self.refused_since = now if self.refused_since is None else self.refused_since
        if now - self.refused_since >= min(self.refused_grace_s, self.master_timeout_s):
            raise MasterGone(
                f"master at {self.url} refuses connections (for {now - self.refused_since:.1f}s): it is gone"
            ) from exc

    def wait_while_busy(self) -> None:
        """A busy master is asked again, less and less often, with no deadline (see _request)."""
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, 5.0)

    def retry_server_error(self) -> bool:
        """A master that fails a request (5xx) is asked again until the deadline; after it, the
        error is the caller's."""
        if time.monotonic() >= self.deadline:
            return False
        time.sleep(self.delay)
        return True


class MasterClient:
    def __init__(self, url: str, token: str, master_timeout_s: float = defaults.MASTER_TIMEOUT_S, refused_grace_s: float = 2.0):
        self.url = url.rstrip("/")
        self.token = token  # also what a round's peer links prove they hold (peer_links.py)
        self.master_timeout_s = master_timeout_s
        self.refused_grace_s = refused_grace_s
        self._http = httpx.Client(
            base_url=self.url + API,
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=2.0),
        )

    def call(self, method: str, path: Route, body=None, content: bytes | None = None, params=None, timeout=None):
        return self._request(method, path, body, content, params, timeout).json()

    def call_bytes(self, method: str, path: Route) -> bytes:
        return self._request(method, path, None, None, None, None).content

    def _request(self, method: str, path: Route, body, content, params, timeout) -> httpx.Response:
        # Read at each call: run_worker sets master_timeout_s from the job's spec after registering.
        patience = _Patience(self.url, self.master_timeout_s, self.refused_grace_s)
        while True:
            attempt = patience.attempt_timeout(timeout)
            try:
                response = self._send(method, path, body, content, params, attempt)
            except httpx.TransportError as exc:
                patience.wait_after_transport_error(exc)
                continue
            if response.status_code == 503 and path == Route.REGISTER:
                # A master that answers 503 is alive and busy (its connections are full): a worker
                # that gave up here would exit and cost its slot a relaunch, so it keeps asking.
                patience.wait_while_busy()
                continue
            if response.status_code >= 500 and patience.retry_server_error():
                continue
            if response.status_code >= 400:
                raise Rejected(response.status_code, response.text[:500])
            return response

    def _send(self, method: str, path: Route, body, content, params, attempt: float) -> httpx.Response:
        """One attempt, its whole time (and at most 2 s of it to connect) bounded by `attempt`."""
        return self._http.request(
            method,
            path,
            json=body.model_dump(mode="json") if hasattr(body, "model_dump") else body,
            content=content,
            params=params,
            timeout=httpx.Timeout(attempt, connect=min(2.0, attempt)),
        )

    def close(self) -> None:
        self._http.close()


def read_token(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read().strip()


def worker_identity() -> tuple[str, str, str]:
    """(master URL, token, worker id) from the environment the backend set."""
    try:
        url = os.environ[WorkerEnv.MASTER_URL]
        worker_id = os.environ[WorkerEnv.WORKER_ID]
        token_file = os.environ[WorkerEnv.TOKEN_FILE]
    except KeyError as exc:
        raise SystemExit(
            f"elastic-step worker: {exc.args[0]} is not set; workers are started by `elastic-step train`"
        ) from None
    return url, read_token(token_file), worker_id
