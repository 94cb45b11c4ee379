"""AppliedKeys: which (task, batch_seq) pushes a shard has applied, for one table, compactly.

A worker pushes a task's batches in order (batch_seq 0, 1, 2, ...), so per task a watermark
("every batch_seq below W is applied") holds almost everything, and only batches applied out
of order wait in a small set above it. A run of a million batches costs a few hundred bytes
per task, not ~100 bytes per batch in a Python set.
"""

from __future__ import annotations

import numpy as np


class AppliedKeys:
    def __init__(self):
        self.below: dict[int, int] = {}  # task -> W: every batch_seq < W is applied
        self.above: dict[int, set[int]] = {}  # task -> applied batch_seqs >= W

    def __contains__(self, key: tuple[int, int]) -> bool:
        task, seq = key
        return seq < self.below.get(task, 0) or seq in self.above.get(task, ())

    def add(self, key: tuple[int, int]) -> None:
        task, seq = key
        watermark = self.below.get(task, 0)
        if seq < watermark:
            return
        pending = self.above.setdefault(task, set())
        pending.add(seq)
        while watermark in pending:
            pending.remove(watermark)
            watermark += 1
        self.below[task] = watermark
        if not pending:
            del self.above[task]

    def __len__(self) -> int:
        return sum(self.below.values()) + sum(len(s) for s in self.above.values())

    def to_arrays(self) -> dict[str, np.ndarray]:
        """For a snapshot: `below` (task, W) rows and `above` (task, batch_seq) rows, int64."""
        above = [(t, s) for t, seqs in self.above.items() for s in sorted(seqs)]
        return {
            "below": np.asarray(sorted(self.below.items()), dtype=np.int64).reshape(-1, 2),
            "above": np.asarray(above, dtype=np.int64).reshape(-1, 2),
        }

    @classmethod
    def from_arrays(cls, below: np.ndarray, above: np.ndarray) -> AppliedKeys:
        keys = cls()
        keys.below = {int(t): int(w) for t, w in below.tolist()}
        for task, seq in above.tolist():
            keys.above.setdefault(int(task), set()).add(int(seq))
        return keys
