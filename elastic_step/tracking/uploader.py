"""A background queue of MLflow calls, run in order, each retried with backoff while MLflow is
unreachable, so training never waits on tracking and nothing queued is lost."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

log = logging.getLogger("elastic_step.tracking")


class Uploader(threading.Thread):
    def __init__(self, max_backoff_s: float = 10.0):
        super().__init__(name="mlflow-uploader", daemon=True)
        self._queue: queue.Queue[tuple[str, Callable[[], None]]] = queue.Queue()
        self.max_backoff_s = max_backoff_s
        self.failures = 0  # calls that had to be retried (MLflow was unreachable)
        self.start()

    def submit(self, what: str, call: Callable[[], None]) -> None:
        self._queue.put((what, call))

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued call has succeeded; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def run(self) -> None:
        while True:
            what, call = self._queue.get()
            delay = 0.2
            while True:
                try:
                    call()
                    break
                except Exception as exc:  # MLflow raises many kinds when its server is away
                    self.failures += 1
                    log.warning("MLflow call %s failed (%s: %s); retrying in %.1fs", what, type(exc).__name__, str(exc)[:200], delay)
                    time.sleep(delay)
                    delay = min(delay * 2, self.max_backoff_s)
            self._queue.task_done()
