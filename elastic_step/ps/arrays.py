"""Row-wise numpy moves that the shards and the client make on every pull and push.

Writing whole rows at scattered positions with fancy indexing (`block[slots] = rows`) copies
element by element; viewing each row as one opaque item and `np.put`-ing those moves a row at a
time, about three times faster (as np.take does for reading them).
"""

from __future__ import annotations

import numpy as np


def put_rows(target: np.ndarray, positions: np.ndarray, rows: np.ndarray) -> None:
    """target[positions] = rows for a C-contiguous 2-D `target` (positions distinct, or the last
    write wins as with indexing); any other shapes go to indexing itself, which checks them."""
    rows = np.ascontiguousarray(rows, dtype=target.dtype)
    if (not target.flags.c_contiguous or target.ndim != 2 or rows.shape[1:] != target.shape[1:]
            or len(rows) != len(positions)):  # np.put would repeat or cut the rows to fit
        target[positions] = rows
        return
    item = np.dtype((np.void, target.shape[1] * target.itemsize))
    np.put(target.view(item).reshape(-1), positions, rows.view(item).reshape(-1))
