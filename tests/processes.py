"""What the tests' own server processes share: they end with the test process that started them."""

from __future__ import annotations


def die_with_parent() -> None:
    """preexec_fn for a server the test process owns: the kernel SIGTERMs it when the test
    process dies, even by SIGKILL (a timeout's kill -9), where no `stop()` or atexit runs and a
    server in a session of its own would otherwise be left listening."""
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
