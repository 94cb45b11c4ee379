"""The worker's side of the master API (httpx). A master that stays unreachable for longer than
`master_timeout_s` is gone: the worker exits on its own, so a dead master leaves no workers."""

from __future__ import annotations

import logging
import os
import time

import httpx

from elastic_step.protocol import API

log = logging.getLogger("elastic_step.worker")


class MasterGone(Exception):
    pass


class Rejected(Exception):
    """The master answered, and said no (4xx)."""

    def __init__(self, status: int, detail: str):
        super().__init__(f"{status}: {detail}")
        self.status = status


class MasterClient:
    def __init__(self, url: str, token: str, master_timeout_s: float = 30.0):
        self.url = url.rstrip("/")
        self.master_timeout_s = master_timeout_s
        self._http = httpx.Client(
            base_url=self.url + API,
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(10.0, connect=2.0),
        )

    def call(self, method: str, path: str, body=None, content: bytes | None = None, params=None, timeout=None):
        return self._request(method, path, body, content, params, timeout).json()

    def call_bytes(self, method: str, path: str) -> bytes:
        return self._request(method, path, None, None, None, None).content

    def _request(self, method: str, path: str, body, content, params, timeout) -> httpx.Response:
        deadline = time.monotonic() + self.master_timeout_s
        delay = 0.05
        while True:
            try:
                response = self._http.request(
                    method,
                    path,
                    json=body.model_dump(mode="json") if hasattr(body, "model_dump") else body,
                    content=content,
                    params=params,
                    timeout=timeout,
                )
            except httpx.TransportError as exc:
                if time.monotonic() > deadline:
                    raise MasterGone(f"master at {self.url} unreachable for {self.master_timeout_s:.0f}s: {exc}") from exc
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            if response.status_code >= 500 and time.monotonic() < deadline:
                time.sleep(delay)
                continue
            if response.status_code >= 400:
                raise Rejected(response.status_code, response.text[:500])
            return response

    def close(self) -> None:
        self._http.close()


def read_token(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read().strip()


def worker_identity() -> tuple[str, str, str]:
    """(master URL, token, worker id) from the environment the backend set."""
    try:
        url = os.environ["ELASTIC_STEP_MASTER_URL"]
        worker_id = os.environ["ELASTIC_STEP_WORKER_ID"]
        token_file = os.environ["ELASTIC_STEP_TOKEN_FILE"]
    except KeyError as exc:
        raise SystemExit(
            f"elastic-step worker: {exc.args[0]} is not set; workers are started by `elastic-step train`"
        ) from None
    return url, read_token(token_file), worker_id
