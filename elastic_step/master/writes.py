"""The master's one lock, and the writes queued under it.

Everything the master decides happens under one lock; nothing slow happens under it. Disk
writes (events.jsonl, metrics.jsonl, the audit file, the master's log, a handed-over checkpoint)
are queued while the lock is held and run by one writer thread, in the order they were queued.
So the order holds across threads: an audit line queued before a checkpoint is handed over is on
disk before that checkpoint's files are written (and so before its commit, which fsyncs both).

A call into the master waits, once it has released the lock, until its own writes ran (and so
every write queued before them), at most WAIT_FOR_WRITES_S. A call that queued nothing returns
at once. Writes are quick; the exception is a checkpoint's, which can wait on the network (a
parameter-server job's cut, up to its timeout, while a shard is stopped). Nothing but the writer
waits out such a write: heartbeats, task requests and step reports are answered meanwhile (a
worker gives its master 30 s before it leaves as if the master were gone), the supervision loop
goes on detecting deaths, and their writes follow in order. A reader of what other threads'
writes record (the rollback's restore point, the job's end) calls `flush()`, which waits for all."""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

log = logging.getLogger("elastic_step.master")

# The longest a call into the master waits for its writes. Past it the call goes on, and its
# writes run later in their turn: below the workers' 10 s request timeout.
WAIT_FOR_WRITES_S = 5.0
# The writer thread ends after this long with nothing to write (the next write starts another).
WRITER_IDLE_S = 2.0


class WriteQueue:
    """Writes in the order they were queued, by one writer thread. A write that fails is logged
    and remembered (`error`); the master fails the job with it at its next tick."""

    def __init__(self, wait_s: float = WAIT_FOR_WRITES_S):
        self.wait_s = wait_s
        self.error: str | None = None
        self._queue: collections.deque[tuple[int, str, Callable[[], None]]] = collections.deque()
        self._changed = threading.Condition()
        self._queued = 0  # the number of the newest write queued (they are numbered from 1)
        self._done = 0  # the number of the newest write run (they run in order)
        self._mine = threading.local()  # .last: the number of the calling thread's newest write
        self._writer: threading.Thread | None = None

    def put(self, what: str, write: Callable[[], None]) -> None:
        """Queue `write` (`what` names it in a log line or an error); called under the master's lock."""
        with self._changed:
            self._queued += 1
            self._mine.last = self._queued
            self._queue.append((self._queued, what, write))
            if self._writer is None:
                self._start_writer()
            self._changed.notify_all()

    def run(self) -> None:
        """Wait until the calling thread's writes ran, at most `wait_s`. (Writes that one of them
        queued in turn, as a checkpoint's queues its event, come later: `flush` waits for those.)"""
        mine = getattr(self._mine, "last", 0)
        if mine <= self._done or threading.current_thread() is self._writer:
            return  # most calls; and a write that took the master's lock never waits for itself
        with self._changed:
            self._changed.wait_for(lambda: self._done >= mine, self.wait_s)

    def flush(self) -> None:
        """Wait until nothing is left to write, whoever queued it. Never under the master's lock
        (a write may take it), nor from a write."""
        if threading.current_thread() is self._writer:
            raise RuntimeError("a queued write cannot wait for the queue")
        with self._changed:
            self._changed.wait_for(lambda: self._done >= self._queued)

    def _write_all(self) -> None:
        me = threading.current_thread()
        try:
            while True:
                with self._changed:
                    if not self._changed.wait_for(lambda: self._queue, WRITER_IDLE_S):
                        self._writer = None  # under the condition: a put from now on starts a new writer
                        return
                    number, what, write = self._queue.popleft()
                try:
                    self._write(what, write)
                finally:
                    with self._changed:
                        self._done = number
                        self._changed.notify_all()
        finally:  # ended by something no write catches (threading reports it): another writer takes over
            with self._changed:
                if self._writer is me:
                    self._writer = None
                    if self._queue:
                        self._start_writer()

    def _start_writer(self) -> None:
        """Under the condition (the new thread waits on it before it reads anything)."""
        writer = threading.Thread(target=self._write_all, name="master-writes", daemon=True)
        writer.start()
        self._writer = writer  # once started: a thread that could not start is never taken for the writer

    def _write(self, what: str, write: Callable[[], None]) -> None:
        began = time.monotonic()
        try:
            write()
        except Exception as exc:
            log.error("could not %s: %s: %s", what, type(exc).__name__, exc)
            if self.error is None:
                self.error = f"could not {what}: {type(exc).__name__}: {exc}"
        took = time.monotonic() - began
        if took > self.wait_s:
            log.warning("took %.1fs to %s; the master answered its workers meanwhile, and wrote what came after it "
                        "once it was done", took, what)


class MasterLock:
    """The master's one lock (re-entrant). Its outermost holder, once it has released it, waits
    for the writes it queued on `writes` while holding it."""

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
