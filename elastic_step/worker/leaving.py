"""SIGTERM on a worker is an eviction, not a failure: the worker leaves its group at once.

Kubernetes sends SIGTERM when it evicts or preempts a pod or drains its node, and SIGKILL after
the grace period. The worker does not wait for its step to end: it exits at once with
WORKER_LEFT_EXIT_CODE, without running destructors (a gloo group mid-collective could abort
noisily). Its peers' collective then fails fast and they regroup in process; the master reads
the exit code as a departure (its rows go back to the queue at the regroup, and no relaunch is
charged). Every row it took part in is either in a step some survivor applied, and reported by
the next round's state source, or returns to the queue: the ledger stays exact, as after SIGKILL.

Two things make this work as a container's first process:
- PID 1 gets no signal whose disposition is the default (the kernel drops it), so the handler is
  an explicit one; without it SIGTERM would be ignored until the grace period's SIGKILL;
- Python runs signal handlers on the main thread between bytecodes, which may be minutes away
  (a collective waiting on a hung peer, a long forward pass). The C-level handler writes the
  signal's number to a wake-up pipe at once, and a thread waiting on that pipe does the leaving.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from elastic_step.protocol import WORKER_LEFT_EXIT_CODE

log = logging.getLogger("elastic_step.worker")


def _noop(signum, frame) -> None:
    """The Python-level handler: the wake-up pipe's thread does the work."""


def _wait_for_sigterm(read_fd: int) -> None:
    while True:
        try:
            received = os.read(read_fd, 64)
        except InterruptedError:
            continue
        if int(signal.SIGTERM) in received:  # other handled signals (SIGINT) write here too
            log.warning("SIGTERM: leaving the group now (exit code %d: a departure, not a failure)", WORKER_LEFT_EXIT_CODE)
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(WORKER_LEFT_EXIT_CODE)


def leave_on_sigterm() -> None:
    """From now on, SIGTERM makes this process leave at once with WORKER_LEFT_EXIT_CODE, even as
    PID 1. Call it from the main thread, first thing (importing a framework takes seconds)."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # a full pipe must never block the signal handler
    signal.signal(signal.SIGTERM, _noop)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_wait_for_sigterm, args=(read_fd,), name="sigterm", daemon=True).start()
