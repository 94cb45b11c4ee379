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


class AppliedGroups:
    """The applied pushes of one table on one shard, per virtual shard: groups of virtual shards
    that share one AppliedKeys.

    Why per virtual shard: a push's ids are split over the shards, one part each, and a part can
    be applied on one shard and refused on another when the routing epoch changes between them.
    Once a virtual shard moves, its rows must carry the keys its old owner applied, and the new
    owner's own rows keep theirs: a key is applied to a virtual shard's rows once, wherever they
    live. `default` covers every virtual shard in no other group (all of them until one is
    moved in); a moved-in virtual shard comes with its old owner's keys as a group of its own.
    A part routed to this shard holds every id of its key that this shard owns (a client re-sends
    a push whole under a new routing), so a key taken is marked in every group that holds a
    virtual shard this shard owns (their vshards that the part has no ids for have nothing to
    apply). A group of virtual shards given away is frozen: `split` cuts them out of their
    groups when the routing changes, and nothing marks them again, so they leave with the keys
    their rows hold.
    """

    def __init__(self, virtual_shards: int, default: AppliedKeys | None = None,
                 extra: list[tuple[np.ndarray, AppliedKeys]] | None = None):
        self.virtual_shards = virtual_shards
        self.default = default or AppliedKeys()
        self.extra = extra or []  # (mask over the virtual shards, their keys)

    def missing(self, key: tuple[int, int]) -> bool:
        """Whether some group has not applied `key` yet."""
        return key not in self.default or any(key not in keys for _, keys in self.extra)

    def take(self, key: tuple[int, int], vshards: np.ndarray, owned: np.ndarray | None = None) -> np.ndarray:
        """Mark `key` applied in every group but the frozen ones (no vshard in `owned`); the
        mask of the rows (by virtual shard) it is new to."""
        if not self.extra:
            fresh = key not in self.default
            self.default.add(key)
            return np.full(len(vshards), fresh)
        fresh, explicit = np.zeros(len(vshards), bool), np.zeros(len(vshards), bool)
        for mask, keys in self.extra:
            inside = mask[vshards]
            explicit |= inside
            if key not in keys and (owned is None or (mask & owned).any()):
                fresh |= inside
                keys.add(key)
        if key not in self.default:
            fresh |= ~explicit
            self.default.add(key)
        return fresh

    def _default_mask(self) -> np.ndarray:
        mask = np.ones(self.virtual_shards, bool)
        for other, _ in self.extra:
            mask &= ~other
        return mask

    def export(self, vshards: np.ndarray) -> list[tuple[np.ndarray, AppliedKeys]]:
        """The groups of `vshards` (masks cut down to them, keys copied): what moves with them."""
        wanted = np.zeros(self.virtual_shards, bool)
        wanted[vshards] = True
        out = []
        for mask, keys in [(self._default_mask(), self.default), *self.extra]:
            if (mask & wanted).any():
                out.append((mask & wanted, AppliedKeys.from_arrays(**keys.to_arrays())))
        return out

    def install(self, groups: list[tuple[np.ndarray, AppliedKeys]]) -> None:
        """Moved-in virtual shards and their keys (replacing whatever group held them)."""
        for mask, _ in groups:
            self.forget(mask)
        self.extra.extend((mask.copy(), keys) for mask, keys in groups)

    def split(self, lost: np.ndarray) -> None:
        """Cut the virtual shards in `lost` (given away by a new routing) out of their groups
        into groups of their own, holding copies of the keys they have now: frozen from here on."""
        groups, self.extra = [(self._default_mask(), self.default), *self.extra], []
        for i, (mask, keys) in enumerate(groups):
            if (mask & lost).any() and (i == 0 or (mask & ~lost).any()):  # the default keeps what is not lost
                self.extra.append((mask & lost, AppliedKeys.from_arrays(**keys.to_arrays())))
                if i:
                    self.extra.append((mask & ~lost, keys))
            elif i:
                self.extra.append((mask, keys))

    def forget(self, mask: np.ndarray) -> None:
        """Take the virtual shards in `mask` out of the explicit groups (they moved away)."""
        self.extra = [(m & ~mask, keys) for m, keys in self.extra if (m & ~mask).any()]

    def compact(self, owned: np.ndarray) -> None:
        """Fold a group of owned virtual shards back into the default one once both hold the same
        keys (a frozen one stays until `forget`)."""
        same = lambda keys: keys.below == self.default.below and keys.above == self.default.above  # noqa: E731
        self.extra = [(m, keys) for m, keys in self.extra if (m & ~owned).any() or not same(keys)]

    def __len__(self) -> int:
        return len(self.default)

    def to_arrays(self) -> dict[str, np.ndarray]:
        """`below`/`above` of the default group, `gI.mask`/`gI.below`/`gI.above` of the others."""
        arrays = dict(self.default.to_arrays())
        for i, (mask, keys) in enumerate(self.extra):
            arrays[f"g{i}.mask"] = mask
            arrays.update({f"g{i}.{k}": v for k, v in keys.to_arrays().items()})
        return arrays

    @classmethod
    def from_arrays(cls, virtual_shards: int, arrays: dict[str, np.ndarray]) -> AppliedGroups:
        extra, i = [], 0
        while f"g{i}.mask" in arrays:
            extra.append((np.asarray(arrays[f"g{i}.mask"], bool), AppliedKeys.from_arrays(arrays[f"g{i}.below"], arrays[f"g{i}.above"])))
            i += 1
        return cls(virtual_shards, AppliedKeys.from_arrays(arrays["below"], arrays["above"]), extra)
