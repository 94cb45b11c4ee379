"""IdIndex: id -> slot for the rows a shard holds, as one numpy open-addressing hash table.

A Python dict costs ~100 bytes per entry, more than a dim-16 row itself. Here the index is one
int32 array of slots (a power of two long, at most 70% full, linear probing) and the ids live
once, in the table's per-slot id array: a probe compares `ids[slot]` with the id it looks for.
That is 8 bytes of id per row plus 4 / load-factor bytes of index (~6-11 bytes). Every
operation is vectorised over a batch of ids: each loop round advances every unresolved probe
by one position, so a batch costs a few numpy passes, not a Python loop per id.
"""

from __future__ import annotations

import numpy as np

EMPTY = -1
MAX_ROWS = 2**31 - 1  # the slots are int32: a table of one shard holds at most this many rows
MAX_LOAD = 0.7
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: multiply, keep the high bits


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

    def _home(self, ids: np.ndarray) -> np.ndarray:
        mixed = ids.astype(np.uint64) * _GOLDEN  # wraps modulo 2**64 by design
        return (mixed >> np.uint64(64 - self.bits)).astype(np.int64)

    def find(self, ids: np.ndarray, slot_ids: np.ndarray) -> np.ndarray:
        """The slot of each id, or -1 where the index does not hold it."""
        result = np.full(len(ids), EMPTY, dtype=np.int64)
        pos = self._home(ids)
        active = np.arange(len(ids))
        mask = (1 << self.bits) - 1
        while len(active):
            slot = self.slots[pos]
            occupied = slot != EMPTY
            hit = occupied.copy()
            hit[occupied] = slot_ids[slot[occupied]] == ids[active[occupied]]
            result[active[hit]] = slot[hit]
            going_on = occupied & ~hit  # an empty position ends a probe: the id is absent
            active, pos = active[going_on], (pos[going_on] + 1) & mask
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
        pos = self._home(ids)
        mask = (1 << self.bits) - 1
        while len(ids):
            free = self.slots[pos] == EMPTY
            # Several ids of the batch may probe the same free position: the first one takes
            # it, the others see it taken and move on, as they would have one at a time.
            _, first = np.unique(pos[free], return_index=True)
            winners = np.flatnonzero(free)[first]
            self.slots[pos[winners]] = new_slots[winners]
            placed = np.zeros(len(ids), dtype=bool)
            placed[winners] = True
            ids, new_slots, pos = ids[~placed], new_slots[~placed], (pos[~placed] + 1) & mask

    def _grow(self, needed: int, slot_ids: np.ndarray) -> None:
        held = self.slots[self.slots != EMPTY]
        self.bits = max(self.bits + 1, int(np.ceil(np.log2(needed / MAX_LOAD))))
        self.slots = np.full(1 << self.bits, EMPTY, dtype=np.int32)
        self._place(slot_ids[held], held)
