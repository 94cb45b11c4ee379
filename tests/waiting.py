"""Polling for a condition in tests: the one helper the cluster tests share."""

from __future__ import annotations

import time


def wait_for(predicate, timeout: float = 20.0, what: str = "condition", interval: float = 0.05):
    """The predicate's first true value, polled every `interval` seconds; an AssertionError
    naming `what` when `timeout` seconds pass without one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"{what} not reached in {timeout}s")
