"""The master's one lock, and the writes that wait for it to be released.

Everything the master decides happens under one lock; nothing slow happens under it. Disk
writes (events.jsonl, metrics.jsonl, the audit file, the master's log, a handed-over checkpoint)
are queued while the lock is held and run when its outermost holder releases it, in the order
they were queued, by that thread. So when a call into the master returns, everything it queued
is written, and the order holds across threads: an audit line queued before a checkpoint is
handed over is on disk before that checkpoint's files are written (and so before its commit,
which fsyncs both)."""

from __future__ import annotations

import collections
import logging
import threading
from typing import Callable

log = logging.getLogger("elastic_step.master")


class WriteQueue:
    """Writes in the order they were queued, one writer at a time. A write that fails is
    logged and remembered (`error`); the master fails the job with it at its next tick."""

    def __init__(self):
        self._queue: collections.deque[tuple[str, Callable[[], None]]] = collections.deque()
        self._writing = threading.Lock()
        self._writer: int | None = None
        self.error: str | None = None

    def put(self, what: str, write: Callable[[], None]) -> None:
        """Queue `write` (`what` names it in an error); called under the master's lock."""
        self._queue.append((what, write))

    def run(self) -> None:
        """Run every queued write, oldest first. A thread that is already writing (a write
        that took the master's lock) leaves the rest to its outer call."""
        if self._writer == threading.get_ident():
            return
        if not self._queue and self._writer is None:
            return  # nothing queued and nobody writing (most calls): no lock to take
        with self._writing:
            self._writer = threading.get_ident()
            try:
                while self._queue:
                    what, write = self._queue.popleft()
                    try:
                        write()
                    except Exception as exc:
                        log.error("could not %s: %s: %s", what, type(exc).__name__, exc)
                        if self.error is None:
                            self.error = f"could not {what}: {type(exc).__name__}: {exc}"
            finally:
                self._writer = None


class MasterLock:
    """The master's one lock (re-entrant). Writes queued on `writes` while it is held run once
    its outermost holder has released it."""

    def __init__(self):
        self._lock = threading.RLock()
        self._depth = 0
        self._owner: int | None = None
        self.writes = WriteQueue()

    def __enter__(self) -> MasterLock:
        self._lock.acquire()
        self._depth += 1
        self._owner = threading.get_ident()
        return self

    def __exit__(self, *exc_info) -> None:
        self._depth -= 1
        outermost = self._depth == 0
        if outermost:
            self._owner = None
        self._lock.release()
        if outermost:
            self.writes.run()

    def held(self) -> bool:
        """Whether the calling thread holds the lock."""
        return self._owner == threading.get_ident()
