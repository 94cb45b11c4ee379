"""IdIndex: id -> slot for the rows a shard holds, as one numpy open-addressing hash table.

A Python dict costs ~100 bytes per entry, more than a dim-16 row itself. Here the index is one
int32 array of slots (a power of two long, at most 70% full, linear probing) and the ids live
once, in the table's per-slot id array: a probe compares `ids[slot]` with the id it looks for.
That is 8 bytes of id per row plus 4 / load-factor bytes of index (~6-11 bytes). Every
operation is vectorised over a batch of ids: each loop round reads a window of consecutive
positions for every unresolved probe (4 at first, doubling up to 64), so a batch costs a few
numpy passes, not a Python loop per id nor a round per position of the longest chain (linear
probing's chains have a long tail, and every round costs a fixed numpy overhead).

A declared table (TableSpec.rows, ids in [0, rows)) of at most DIRECT_MAX_ROWS rows gets a
DirectIndex instead: one int32 slot per id of the whole table, found with a single gather. That
is 4 bytes per declared id on every shard, whatever share the shard holds, so it is kept for
tables small enough that this is at most 64 MiB per table on a shard; in exchange a pull or push probes
nothing (the hash index's probing was a tenth of a training step: benchmarks/bench_sparse.py).
A snapshot does not keep a direct index (it is rebuilt from the held ids with one scatter).
"""

from __future__ import annotations

import numpy as np

EMPTY = -1
MAX_ROWS = 2**31 - 1  # the slots are int32: a table of one shard holds at most this many rows
MAX_LOAD = 0.7
FIRST_WINDOW = 4  # positions a probe reads in its first vectorised round (most ids end there)
LAST_WINDOW = 64  # the widest window: a round costs its width in every probe still going on
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: multiply, keep the high bits
DIRECT_MAX_ROWS = 1 << 24  # declared tables up to this many ids: a DirectIndex (at most 64 MiB per table on a shard)


class IdIndex:
    def __init__(self, capacity_hint: int = 0):
        self.bits = max(4, int(np.ceil(np.log2(max(16, capacity_hint / MAX_LOAD)))))
        self.slots = np.full(1 << self.bits, EMPTY, dtype=np.int32)
        self.count = 0

    @classmethod
    def from_slots(cls, slots: np.ndarray, count: int) -> IdIndex:
        """An index saved with its table (a snapshot): rebuilding 2.5M rows takes seconds, this
        nothing. Refused unless it is a power of two long and holds exactly slots 0..count-1."""
        bits = int(len(slots)).bit_length() - 1
        held = slots[slots != EMPTY]
        if len(slots) != 1 << bits or slots.dtype != np.int32 or len(held) != count or (count and held.max() >= count):
            raise ValueError("a saved id index that does not fit its table")
        index = cls()
        index.bits, index.slots, index.count = bits, slots, count
        return index

    @property
    def nbytes(self) -> int:
        return self.slots.nbytes

    @property
    def saved(self) -> np.ndarray:
        """What a snapshot keeps of it: its slots (from_slots takes them back, no rebuild)."""
        return self.slots

    def _home(self, ids: np.ndarray) -> np.ndarray:
        mixed = ids.astype(np.uint64) * _GOLDEN  # wraps modulo 2**64 by design
        return (mixed >> np.uint64(64 - self.bits)).astype(np.int64)

    def _windows(self, pos: np.ndarray, width: int) -> np.ndarray:
        """The slots at `width` consecutive positions from each of `pos` (wrapping), one row per
        offset (width x len(pos)): reductions over the offsets then run along whole rows.
        np.take (mode "wrap": modulo the power-of-two length) gathers faster than indexing."""
        return np.take(self.slots, pos + np.arange(width)[:, None], mode="wrap")

    def find(self, ids: np.ndarray, slot_ids: np.ndarray) -> np.ndarray:
        """The slot of each id, or -1 where the index does not hold it."""
        result = np.full(len(ids), EMPTY, dtype=np.int64)
        pos, active, width = self._home(ids), np.arange(len(ids)), FIRST_WINDOW
        while len(active):
            window = self._windows(pos, width)
            empty = window == EMPTY  # slot_ids[-1] below reads some row: an empty position is no hit
            hit = ~empty & (np.take(slot_ids, window) == ids[active])
            # An id sits before the first empty position from its home (linear probing), so a
            # window holding it or an empty position ends its probe.
            result[active] = np.where(hit, window, EMPTY).max(axis=0)
            going_on = ~(hit | empty).any(axis=0)
            active, pos = active[going_on], pos[going_on] + width
            width = min(2 * width, LAST_WINDOW)  # the few long chains left: a few wide rounds, not one per position
        return result

    def insert(self, ids: np.ndarray, new_slots: np.ndarray, slot_ids: np.ndarray) -> None:
        """Index distinct ids that it does not hold yet; slot_ids must already name them."""
        if self.count + len(ids) > MAX_ROWS:
            raise OverflowError(f"a parameter-server shard holds at most {MAX_ROWS:,} rows of one table (its index's "
                                f"slots are int32) and this one would hold {self.count + len(ids):,}: run more shards "
                                "(train --ps-shards, or scale --ps while it trains)")
        if (self.count + len(ids)) > MAX_LOAD * len(self.slots):
            self._grow(self.count + len(ids), slot_ids)
        self._place(ids, new_slots.astype(np.int32))
        self.count += len(ids)

    def _place(self, ids: np.ndarray, new_slots: np.ndarray) -> None:
        pos, width = self._home(ids), FIRST_WINDOW
        while len(ids):
            empty = self._windows(pos, width) == EMPTY
            first_free = np.where(empty, np.arange(width)[:, None], width).min(axis=0)  # width: none
            claim = np.flatnonzero(first_free < width)
            target = (pos[claim] + first_free[claim]) & ((1 << self.bits) - 1)
            # Several ids of the batch may claim the same free position: one write lands, and
            # the others, reading the position back, go on probing past it as they would have
            # one at a time (every position before a claimed one was taken already).
            self.slots[target] = new_slots[claim]
            going_on = np.ones(len(ids), dtype=bool)
            going_on[claim] = self.slots[target] != new_slots[claim]
            pos = (pos + first_free + (first_free < width))[going_on]
            ids, new_slots = ids[going_on], new_slots[going_on]
            width = min(2 * width, LAST_WINDOW)

    @staticmethod
    def distinct(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the distinct ids among `ids`, each id's index among them): a sort, as np.unique."""
        return np.unique(ids, return_inverse=True)

    def _grow(self, needed: int, slot_ids: np.ndarray) -> None:
        held = self.slots[self.slots != EMPTY]
        self.bits = max(self.bits + 1, int(np.ceil(np.log2(needed / MAX_LOAD))))
        self.slots = np.full(1 << self.bits, EMPTY, dtype=np.int32)
        self._place(slot_ids[held], held)


class DirectIndex:
    """id -> slot for a declared table's ids, [0, rows): `slots[id]`, or EMPTY where not held."""

    def __init__(self, rows: int):
        self.slots = np.full(rows, EMPTY, dtype=np.int32)
        self.count = 0

    @property
    def nbytes(self) -> int:
        return self.slots.nbytes

    @property
    def saved(self) -> np.ndarray:
        """What a snapshot keeps of it: nothing. It is rebuilt from the held ids with one scatter,
        and saving it would write 4 bytes per declared id on every shard at every snapshot."""
        return np.empty(0, np.int32)

    def clear(self) -> None:
        self.slots.fill(EMPTY)
        self.count = 0

    def find(self, ids: np.ndarray, slot_ids: np.ndarray) -> np.ndarray:
        """The slot of each id, or -1 where it is not held (an id outside the table included)."""
        outside = outside_rows(ids, len(self.slots))
        if outside is None:
            return np.take(self.slots, ids)  # int32 as held: no copy to int64 (np.take: faster than indexing)
        result = np.full(len(ids), EMPTY, dtype=np.int32)
        result[~outside] = self.slots[ids[~outside]]
        return result

    def distinct(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the distinct ids among `ids`, and each id's index among them) without a sort: each
        position writes a mark into its id's slot, and the positions whose mark stayed are one per
        id (a pull's ids are distinct already, and a sort of them cost more than the rest of the
        index's work). For ids it does not hold (the table's new rows): their slots are left
        empty again, so a held id given here would lose its slot."""
        if outside_rows(ids, len(self.slots)) is not None:  # a negative one would mark another id's slot
            raise ValueError(f"ids outside the table's declared {len(self.slots):,} rows")
        positions = np.arange(len(ids))
        self.slots[ids] = -2 - positions  # below EMPTY: no slot
        kept = -2 - np.take(self.slots, ids)  # for each position, the one position of its id that kept its mark
        first = np.flatnonzero(kept == positions)
        self.slots[ids[first]] = EMPTY
        order = np.empty(len(ids), np.int64)
        order[first] = np.arange(len(first))
        return ids[first], order[kept]

    def insert(self, ids: np.ndarray, new_slots: np.ndarray, slot_ids: np.ndarray) -> None:
        """Index distinct ids of the table that it does not hold yet."""
        if outside_rows(ids, len(self.slots)) is not None:
            raise ValueError(f"ids outside the table's declared {len(self.slots):,} rows")
        self.slots[ids] = new_slots
        self.count += len(ids)


def outside_rows(ids: np.ndarray, rows: int) -> np.ndarray | None:
    """Which ids fall outside [0, rows), or None when none does (two reductions: no mask is made
    for the usual batch, all inside)."""
    if not len(ids) or (ids.min() >= 0 and ids.max() < rows):
        return None
    return (ids < 0) | (ids >= rows)


def uses_direct_index(rows: int) -> bool:
    """Whether a table declared with `rows` ids (0: undeclared) is indexed directly."""
    return 0 < rows <= DIRECT_MAX_ROWS


def new_index(rows: int, capacity: int) -> IdIndex | DirectIndex:
    """An empty index for a table declared with `rows` ids (0: undeclared) holding up to `capacity` rows."""
    return DirectIndex(rows) if uses_direct_index(rows) else IdIndex(capacity)
