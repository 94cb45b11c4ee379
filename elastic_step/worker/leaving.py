"""How a worker leaves before its job ends: always through its main thread.

Two things end a worker from outside its step loop:
- SIGTERM, an eviction, not a failure. Kubernetes sends it when it evicts or preempts a pod or
  drains its node, and SIGKILL after the grace period. The worker leaves its group at once, with
  WORKER_LEFT_EXIT_CODE: its peers' collective fails fast and they regroup in process, and the
  master reads the code as a departure (its rows go back to the queue at the regroup, and no
  relaunch is charged). Every row it took part in is either in a step some survivor applied, and
  reported by the next round's state source, or returns to the queue: the ledger stays exact, as
  after SIGKILL.
- its master is gone (the heartbeat or the step reporter found it so): nobody will ever tell it
  to stop, so it leaves with MASTER_GONE_EXIT_CODE.

The thread that notices does not end the process itself: it records why (`depart`, a
LeaveReason) and wakes the main thread with WAKE_SIGNAL, sent to that thread until it takes it
(a blocking system call there returns at once). The signal's handler raises `Leave` there, which unwinds the worker
through its `finally` blocks (the gloo group destroyed, the heartbeat halted) up to
`run_until_leaving`, and `elastic-step worker` exits with the reason's code, its logs flushed.

What bounds the way out: Python runs the handler between bytecodes, so a main thread inside a
native call takes it when that call returns, and every native call the worker makes is bounded:
a request to the master (10 s, 30 s for the rendezvous poll), the master's store and a collective
(the collective timeout, 30 s by default; a dead peer fails gloo within a fraction of a second),
a group's start (10 s). Only native code that ignores its own timeout could hold the main thread
longer: see `_last_resort`.

Two things make SIGTERM work as a container's first process:
- PID 1 gets no signal whose disposition is the default (the kernel drops it), so the handler is
  an explicit one; without it SIGTERM would be ignored until the grace period's SIGKILL;
- the kernel may hand SIGTERM to any thread, and a Python handler runs only on the main thread,
  between bytecodes: the C-level handler writes the signal's number to a wake-up pipe at once,
  and a thread waiting on that pipe calls `depart`, which wakes the main thread itself.
"""

from __future__ import annotations

import enum
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable

from elastic_step.protocol import WORKER_LEFT_EXIT_CODE
from elastic_step.worker.client import MasterGone

log = logging.getLogger("elastic_step.worker")

# A worker whose master is gone exits with this code (nobody reads it: the master is gone; a
# pod's status shows it).
MASTER_GONE_EXIT_CODE = 3
# Sent to the main thread by the thread that found the worker must leave.
WAKE_SIGNAL = signal.SIGUSR1
# Twice the default collective timeout, the longest bounded wait of the main thread.
LAST_RESORT_S = 60.0
# How often the main thread is signalled again until it has taken the Leave (see _wake_main).
WAKE_EVERY_S = 0.05


class LeaveReason(enum.Enum):
    EVICTED = "SIGTERM"  # an eviction or preemption: a departure, not a failure
    MASTER_GONE = "master gone"  # nobody will ever tell this worker to stop

    @property
    def exit_code(self) -> int:
        return WORKER_LEFT_EXIT_CODE if self is LeaveReason.EVICTED else MASTER_GONE_EXIT_CODE


class Leave(BaseException):
    """Raised on the main thread when the worker must leave. A BaseException, as SystemExit is,
    so that no `except Exception` on the way (a warm-up's, a model definition's) holds it."""

    def __init__(self, reason: LeaveReason, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class _Departure:
    """The one reason this worker leaves (the first given wins), raised on the main thread once."""

    def __init__(self):
        self.lock = threading.Lock()
        self.leave: Leave | None = None
        self.raised = False

    def record(self, reason: LeaveReason, detail: str) -> bool:
        """True when this is the first reason given."""
        with self.lock:
            if self.leave is not None:
                return False
            self.leave = Leave(reason, detail)
            return True


_departure = _Departure()


def depart(reason: LeaveReason, detail: str) -> None:
    """From any thread: this worker must leave, for `reason`. Wakes the main thread, which leaves
    through `run_until_leaving` (where `leave_on_sigterm` made the main thread able to: without
    it, as in a test that drives a Heartbeat in process, the reason is only recorded)."""
    if not _departure.record(reason, detail):
        return
    log.warning("%s; the main thread leaves (exit code %d)", detail, reason.exit_code)
    if signal.getsignal(WAKE_SIGNAL) is not _raise_departure:
        return
    threading.Thread(target=_wake_main, args=(reason,), name="wake-main", daemon=True).start()


def departure() -> Leave | None:
    """Why this worker leaves (None: it does not)."""
    return _departure.leave


def _raise_departure(signum, frame) -> None:
    """WAKE_SIGNAL's handler, on the main thread: raise the recorded Leave, once."""
    if _departure.leave is not None and not _departure.raised:
        _departure.raised = True
        raise _departure.leave


def _wake_main(reason: LeaveReason) -> None:
    """Signal the main thread until it has taken the Leave: a signal that lands just before it
    enters a blocking call is handled at C level then, and does not interrupt that call, so one
    signal alone could wait on the call's own timeout. Then, the last resort."""
    main, deadline = threading.main_thread().ident, time.monotonic() + LAST_RESORT_S
    while time.monotonic() < deadline:
        if not _departure.raised:
            signal.pthread_kill(main, WAKE_SIGNAL)
        time.sleep(WAKE_EVERY_S)
    _last_resort(reason)


def _last_resort(reason: LeaveReason) -> None:
    """The one place a worker ends without its main thread, and only if that thread has not left
    LAST_RESORT_S after it was woken: then it is in native code that ignores its own timeout (a
    driver call, a user's extension). For SIGTERM the sender's SIGKILL would end it too, but
    nothing ends a worker whose master is gone, which would hold its cores or GPU for good. Every
    thread's stack goes to stderr first, to show where the main thread was held."""
    log.error("the main thread did not leave within %g s of being told to (%s): ending the process; stacks follow",
              LAST_RESORT_S, reason.value)
    logging.shutdown()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    os._exit(reason.exit_code)


def run_until_leaving(run: Callable[[], int]) -> int:
    """`run()`'s exit code, or the leaving reason's when the worker must leave: told by another
    thread (Leave), or finding its master gone on the main thread itself."""
    try:
        try:
            return run()
        except MasterGone as exc:
            _departure.record(LeaveReason.MASTER_GONE, str(exc))
            _departure.raised = True  # a wake-up still in flight must not raise it a second time
            raise _departure.leave from None
    except Leave as leave:
        _departure.raised = True
        log.warning("worker leaves: %s (exit code %d)", leave.detail, leave.reason.exit_code)
        return leave.reason.exit_code


def _noop(signum, frame) -> None:
    """SIGTERM's Python-level handler: the wake-up pipe's thread does the work."""


def _wait_for_sigterm(read_fd: int) -> None:
    while True:
        try:
            received = os.read(read_fd, 64)
        except InterruptedError:
            continue
        if int(signal.SIGTERM) in received:  # other handled signals (SIGINT, WAKE_SIGNAL) write here too
            depart(LeaveReason.EVICTED, "SIGTERM: leaving the group now (a departure, not a failure)")


def leave_on_sigterm() -> None:
    """From now on, SIGTERM makes this worker leave at once with WORKER_LEFT_EXIT_CODE, even as
    PID 1, and `depart` can wake the main thread. Call it from the main thread, first thing
    (importing a framework takes seconds), and run the worker under `run_until_leaving`."""
    signal.signal(WAKE_SIGNAL, _raise_departure)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # a full pipe must never block the signal handler
    signal.signal(signal.SIGTERM, _noop)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_wait_for_sigterm, args=(read_fd,), name="sigterm", daemon=True).start()
