"""The master's one lock, and the writes that wait for it to be released.

Everything the master decides happens under one lock; nothing slow happens under it. Disk
writes (events.jsonl, metrics.jsonl, the audit file, the master's log, a handed-over checkpoint)
are queued while the lock is held and run when its outermost holder releases it, in the order
they were queued, one writer at a time. So when a call into the master returns, everything it
queued is written, and the order holds across threads: an audit line queued before a checkpoint
is handed over is on disk before that checkpoint's files are written (and so before its commit,
which fsyncs both).

A call that queued nothing returns at once, even while another thread's write is under way: a
checkpoint's write can wait on the network (a parameter-server job's cut, up to its timeout), and
heartbeats and task requests must not wait behind it, or a slow shard would stall every worker.
A reader of what other threads' writes record (the rollback's restore point, the job's end) calls
`flush()` first."""

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
        self._queue: collections.deque[tuple[int, str, Callable[[], None]]] = collections.deque()
        self._writing = threading.Lock()
        self._writer: int | None = None
        self._queued = 0  # the number of the newest write queued (they are numbered from 1)
        self._done = 0  # the number of the newest write run (they run in order)
        self._mine = threading.local()  # .last: the number of the calling thread's newest write
        self.error: str | None = None

    def put(self, what: str, write: Callable[[], None]) -> None:
        """Queue `write` (`what` names it in an error); called under the master's lock."""
        self._queued += 1
        self._mine.last = self._queued
        self._queue.append((self._queued, what, write))

    def run(self) -> None:
        """Run the calling thread's queued writes, and every write queued before them. A thread
        with none waiting returns at once; one that is already writing (a write that took the
        master's lock) leaves the rest to its outer call."""
        self._run_until(0)

    def flush(self) -> None:
        """Run every write queued so far, whoever queued it. Never under the master's lock: a
        write may take it."""
        self._run_until(self._queued)

    def _run_until(self, number: int) -> None:
        def wanted() -> int:
            return max(number, getattr(self._mine, "last", 0))

        if self._writer == threading.get_ident() or wanted() <= self._done:
            return  # most calls: nothing of theirs is waiting, no lock to take
        with self._writing:
            self._writer = threading.get_ident()
            try:
                while self._queue and self._done < wanted():  # a write's own writes are wanted too
                    self._write(*self._queue.popleft())
            finally:
                self._writer = None

    def _write(self, number: int, what: str, write: Callable[[], None]) -> None:
        try:
            write()
        except Exception as exc:
            log.error("could not %s: %s: %s", what, type(exc).__name__, exc)
            if self.error is None:
                self.error = f"could not {what}: {type(exc).__name__}: {exc}"
        finally:
            self._done = number


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
