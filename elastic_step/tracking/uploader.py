"""A background queue of MLflow calls, run in order, so training never waits on tracking.

A call that fails because MLflow is away (no connection, a 5xx, throttling) is retried with backoff
for up to `max_retry_s`: checkpoints wait on local disk meanwhile and nothing queued is lost. A
call MLflow rejects (a 4xx: a bad metric name, a missing run, no permission) will never succeed:
it fails at once. Either failure stops the queue for good and sets `error`, one line that says
what was refused and why; the job then fails rather than train on without its records."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

from elastic_step.tracking.uri import redact

log = logging.getLogger("elastic_step.tracking")

# MLflow error codes that mean "this request is wrong", whatever the transport said
_PERMANENT_CODES = {
    "INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS", "INVALID_STATE",
    "BAD_REQUEST", "PERMISSION_DENIED", "UNAUTHENTICATED", "MALFORMED_REQUEST", "RESOURCE_CONFLICT",
    "INVALID_REQUEST", "NOT_IMPLEMENTED", "FEATURE_DISABLED", "CUSTOMER_UNAUTHORIZED",
}


def is_permanent(exc: BaseException) -> bool:
    """True when retrying `exc`'s call cannot help: MLflow answered, and said no."""
    try:
        from mlflow.exceptions import MlflowException
    except ImportError:  # pragma: no cover - mlflow is a dependency
        return False
    if not isinstance(exc, MlflowException):
        return False  # connection errors, timeouts, OS errors: MLflow (or the network) is away
    status = None
    try:
        status = exc.get_http_status_code()
    except Exception:
        pass
    code = getattr(exc, "error_code", "") or ""
    if code in ("TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED", "INTERNAL_ERROR", "DEADLINE_EXCEEDED"):
        return False
    if code in _PERMANENT_CODES:
        return True
    return isinstance(status, int) and 400 <= status < 500 and status not in (408, 429)


def one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return redact(f"{type(exc).__name__}: {text[:limit]}")


class Uploader(threading.Thread):
    def __init__(self, max_backoff_s: float = 10.0, max_retry_s: float = 600.0):
        super().__init__(name="mlflow-uploader", daemon=True)
        self._queue: queue.Queue[tuple[str, Callable[[], None]]] = queue.Queue()
        self.max_backoff_s = max_backoff_s
        self.max_retry_s = max_retry_s
        self.failures = 0  # calls that had to be retried (MLflow was unreachable)
        self.error: str | None = None  # set once, when a call failed for good; nothing runs after
        self.start()

    def submit(self, what: str, call: Callable[[], None]) -> None:
        self._queue.put((what, call))

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued call has succeeded; False on timeout or once a call failed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if self.error is not None or (deadline is not None and time.monotonic() > deadline):
                return False
            time.sleep(0.05)
        return self.error is None

    def run(self) -> None:
        while True:
            what, call = self._queue.get()
            if self.error is None:
                self._run_one(what, call)
            self._queue.task_done()

    def _run_one(self, what: str, call: Callable[[], None]) -> None:
        delay = 0.2
        give_up = time.monotonic() + self.max_retry_s
        while True:
            try:
                call()
                return
            except Exception as exc:  # MLflow raises many kinds when its server is away
                if is_permanent(exc):
                    self.error = f"MLflow rejected {what}: {one_line(exc)}"
                    log.error("%s", self.error)
                    return
                if time.monotonic() + delay > give_up:
                    self.error = f"MLflow did not accept {what} for {self.max_retry_s:.0f}s: {one_line(exc)}"
                    log.error("%s", self.error)
                    return
                self.failures += 1
                log.warning("MLflow call %s failed (%s); retrying in %.1fs", what, one_line(exc, 200), delay)
                time.sleep(delay)
                delay = min(delay * 2, self.max_backoff_s)
