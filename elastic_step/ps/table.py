"""EmbeddingTable: one table's rows on one shard, in one float32 block.

Row `slot` of `block` is [weights | optimizer slots] (optimizers.py), `ids[slot]` its id and
`updates[slot]` how many pushes changed it (the audit's per-row counter, and lazy Adam's step).
The id index (index.py) maps ids to slots. A row is created on its first pull or push with values drawn from
(table seed, id) alone, so every shard that ever owns the id creates the same row.

Bytes per row at dim 16 + Adagrad: 128 of payload, 8 of id, 4 of counter and ~6-11 of a hash
index (a direct index instead: 4 per declared id, index.py).
"""

from __future__ import annotations

import hashlib
from collections import deque

import numpy as np

from elastic_step.ps.api import SLOTS, TableSpec
from elastic_step.ps.arrays import put_rows
from elastic_step.ps.index import DirectIndex, IdIndex, new_index, outside_rows
from elastic_step.ps.optimizers import apply_rows, initial_slots

GROWTH = 1.25  # a modest factor: the block's spare rows are part of the bytes per row
RECENT_PULLS = 16  # pulls whose slots a push of the same ids reuses: a few steps in flight per worker
DROP_PART = 1 << 16  # rows moved at a time when a table forgets rows (drop)
RECENT_IDS = 1 << 20  # and at most this many ids among them (16 MiB a table), whatever the batch size
_SEED_MIX = 0xD1B54A32D192ED03


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer of each key, in place (`z`, uint64, is overwritten and returned)."""
    z += np.uint64(0x9E3779B97F4A7C15)
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


def initial_weights(spec: TableSpec, ids: np.ndarray) -> np.ndarray:
    """Each id's starting row: uniform in [-init_scale, init_scale], a function of (seed, id).
    (In place where it can: a pull of new ids makes their rows on every step.)"""
    offsets = np.arange(spec.dim, dtype=np.uint64) + np.uint64((spec.seed * _SEED_MIX) % (1 << 64))  # a seed's own stream
    keys = ids.astype(np.uint64)[:, None] * np.uint64(spec.dim) + offsets
    unit = (_splitmix64(keys) >> np.uint64(40)).astype(np.float32)
    unit /= np.float32(1 << 24)
    unit *= 2
    unit -= 1
    unit *= np.float32(spec.init_scale)
    return unit


def _repeats(slots: np.ndarray) -> bool:
    """Whether any slot occurs twice: a sort (no argsort), as a push's ids are distinct but for
    rare cases; of int32 (a shard's slots are: index.MAX_ROWS), which sorts twice as fast."""
    ordered = np.sort(slots.astype(np.int32, copy=False))
    return bool((ordered[1:] == ordered[:-1]).any())


def _own_array(array: np.ndarray, dtype) -> bool:
    return array.dtype == dtype and array.flags.c_contiguous and array.flags.writeable and array.flags.owndata


class EmbeddingTable:
    def __init__(self, spec: TableSpec, reserve: int = 0):
        """`reserve`: rows to make room for up front (a shard's share of the declared size), so
        the block and the index do not grow, copying every row, while the table fills."""
        self.spec = spec
        self.width = spec.dim * (1 + SLOTS[spec.optimizer])
        self.reserved = reserve
        capacity = max(16, reserve)
        self.block = np.empty((capacity, self.width), np.float32)
        self.ids = np.empty(capacity, np.int64)
        self.updates = np.zeros(capacity, np.uint32)
        self.size = 0
        self.index = new_index(spec.rows, capacity)
        # (ids, slots) of recent pulls: a worker pushes the gradients of exactly the ids it pulled
        # for the step, so the push finds their slots here instead of probing the index again.
        # A row keeps its slot until load() or drop() (which clear this), so a remembered slot stays right.
        self._recent: deque[tuple[np.ndarray, np.ndarray]] = deque()
        self._recent_ids = 0

    @property
    def nbytes(self) -> int:
        return self.block.nbytes + self.ids.nbytes + self.updates.nbytes + self.index.nbytes

    def slots_of(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id (any order, repeats allowed), creating the rows not held yet."""
        slots = self.index.find(ids, self.ids)
        missing = np.flatnonzero(slots < 0)
        if len(missing):
            new_ids, inverse = self.index.distinct(ids[missing])
            first = self.size
            self._create(new_ids)
            slots[missing] = first + inverse  # _create gives new_ids the slots first, first + 1, ...: no second probe
        return slots

    def _create(self, new_ids: np.ndarray) -> None:
        start, end = self.size, self.size + len(new_ids)
        if end > len(self.ids):
            self._reserve(max(end, int(len(self.ids) * GROWTH)))
        self.ids[start:end] = new_ids
        self.block[start:end, : self.spec.dim] = initial_weights(self.spec, new_ids)
        self.block[start:end, self.spec.dim :] = initial_slots(self.spec, len(new_ids))
        self.updates[start:end] = 0
        self.index.insert(new_ids, np.arange(start, end), self.ids)
        self.size = end

    def _reserve(self, capacity: int) -> None:
        n = self.size
        block, ids, updates = np.empty((capacity, self.width), np.float32), np.empty(capacity, np.int64), np.zeros(capacity, np.uint32)
        block[:n], ids[:n], updates[:n] = self.block[:n], self.ids[:n], self.updates[:n]
        self.block, self.ids, self.updates = block, ids, updates

    def pull(self, ids: np.ndarray) -> np.ndarray:
        """The weights of each id (len(ids) x dim); zeros for an id outside a declared table's
        range, which no row is made for (as a served model gives it: training refuses it)."""
        outside = self.outside(ids)
        if outside is not None:
            rows = np.zeros((len(ids), self.spec.dim), np.float32)
            rows[~outside] = self.pull(ids[~outside])
            return rows
        slots = self.slots_of(ids)  # first: it may grow (replace) the block
        self._remember(ids, slots)
        # np.take gathers whole rows ~3x faster than fancy indexing; the result is a fresh array.
        return np.take(self.block, slots, axis=0)[:, : self.spec.dim]

    def outside(self, ids: np.ndarray) -> np.ndarray | None:
        """Which ids are outside a declared table's [0, rows), or None when none is."""
        return outside_rows(ids, self.spec.rows) if self.spec.rows else None

    def push(self, ids: np.ndarray, grads: np.ndarray) -> None:
        """Apply one update: `grads` (len(ids) x dim) merged per id (repeated ids are summed
        here too, since fancy-index assignment would keep only one of them)."""
        slots = self._pulled_slots(ids)
        if slots is None:
            slots = self.slots_of(ids)
        grads = grads.astype(np.float32, copy=False)
        if _repeats(slots):
            slots, inverse = np.unique(slots, return_inverse=True)
            merged = np.zeros((len(slots), self.spec.dim), np.float32)
            np.add.at(merged, inverse, grads)
            grads = merged
        rows = np.take(self.block, slots, axis=0)
        steps = np.take(self.updates, slots) + np.uint32(1)
        apply_rows(self.spec, rows, grads, steps)
        put_rows(self.block, slots, rows)
        self.updates[slots] = steps

    def _remember(self, ids: np.ndarray, slots: np.ndarray) -> None:
        self._recent.append((np.array(ids, dtype=np.int64), slots))  # a copy: the caller's buffer may be reused
        self._recent_ids += len(ids)
        while len(self._recent) > RECENT_PULLS or self._recent_ids > RECENT_IDS:
            self._recent_ids -= len(self._recent.popleft()[0])

    def _forget_pulls(self) -> None:
        self._recent.clear()
        self._recent_ids = 0

    def _reindex(self) -> None:
        """An index of the held rows, sized for the block's capacity (a direct one is cleared and
        refilled: a second one beside it would cost 4 bytes per declared id more)."""
        if isinstance(self.index, DirectIndex):
            self.index.clear()
        else:
            self.index = new_index(self.spec.rows, len(self.ids))
        try:
            self.index.insert(self.ids[: self.size], np.arange(self.size), self.ids)
        except ValueError:  # only a direct index refuses ids: rows held under other settings, which it cannot serve
            raise ValueError(f"table {self.spec.name!r} holds ids outside its declared {self.spec.rows:,} rows (a "
                             "snapshot of a job that declared it larger, or none): declare the rows= it was trained with") from None

    def _pulled_slots(self, ids: np.ndarray) -> np.ndarray | None:
        """The slots of a recent pull of exactly these ids, in this order (None: none was)."""
        for pulled, slots in reversed(self._recent):
            if len(pulled) == len(ids) and np.array_equal(pulled, ids):
                return slots
        return None

    def counters(self) -> dict[int, int]:
        """id -> update count of every row held (for audits and tests; not for big tables)."""
        return dict(zip(self.ids[: self.size].tolist(), self.updates[: self.size].tolist()))

    def arrays(self) -> dict[str, np.ndarray]:
        """The held rows and the id index as arrays (views), for a snapshot."""
        n = self.size
        return {"ids": self.ids[:n], "rows": self.block[:n], "updates": self.updates[:n], "index": self.index.saved}

    def load(self, ids: np.ndarray, rows: np.ndarray, updates: np.ndarray, index: np.ndarray | None = None) -> None:
        """Replace the table's rows by a snapshot's (rebuilding the index if it has none)."""
        capacity = max(16, len(ids), self.reserved)
        if rows.shape != (len(ids), self.width) or updates.shape != ids.shape:
            raise ValueError(f"table {self.spec.name}: a snapshot whose rows do not fit dim {self.spec.dim} and its optimizer")
        self.size = len(ids)
        self._forget_pulls()  # rows take new slots
        if capacity == len(ids) and _own_array(rows, np.float32) and _own_array(ids, np.int64) and _own_array(updates, np.uint32):
            self.block, self.ids, self.updates = rows, ids, updates  # a snapshot's fresh arrays: no copy
        else:
            self.block = np.empty((capacity, self.width), np.float32)
            self.ids = np.empty(capacity, np.int64)
            self.updates = np.zeros(capacity, np.uint32)
            self.block[: self.size], self.ids[: self.size], self.updates[: self.size] = rows, ids, updates
        if index is not None and len(index) and isinstance(self.index, IdIndex):  # a mapped snapshot's is read-only: the index writes its slots
            self.index = IdIndex.from_slots(index if index.flags.writeable else np.array(index), self.size)
        else:  # a direct index is not saved (nor is one in a snapshot from before the table had it used)
            self._reindex()

    def where(self, keep: np.ndarray) -> dict[str, np.ndarray]:
        """Copies of the held rows where `keep` (one flag per held row): what a move ships."""
        n = self.size
        return {"ids": self.ids[:n][keep].copy(), "rows": self.block[:n][keep].copy(), "updates": self.updates[:n][keep].copy()}

    def drop(self, gone: np.ndarray) -> None:
        """Forget the held rows where `gone` (rows that moved to another shard), moving the kept
        ones to the front of the block in place, a part at a time: no second copy of the table is
        held meanwhile (a declared table's block is its reservation, kept)."""
        if not gone.any():
            return
        keep = np.flatnonzero(~gone)
        # keep[i] >= i: a part is read (a copy) before it is written, and only over rows already moved
        for start in range(0, len(keep), DROP_PART):
            part = keep[start : start + DROP_PART]
            end = start + len(part)
            self.block[start:end], self.ids[start:end], self.updates[start:end] = self.block[part], self.ids[part], self.updates[part]
        self.size = len(keep)
        self._forget_pulls()  # rows took new slots
        self._reindex()

    def put(self, ids: np.ndarray, rows: np.ndarray, updates: np.ndarray) -> None:
        """Hold these rows as given (moved in), replacing any held for the same ids."""
        if len(ids):
            slots = self.slots_of(ids)
            self.block[slots], self.updates[slots] = rows, updates

    def digest(self) -> str:
        """A hash of every held row, its slots and counter, in id order: equal tables, equal digests."""
        order = np.argsort(self.ids[: self.size], kind="stable")
        h = hashlib.blake2b(digest_size=16)
        for part in (self.ids[order], self.block[order], self.updates[order]):
            h.update(np.ascontiguousarray(part).tobytes())
        return h.hexdigest()
