"""The id index's probes: long chains (many ids sharing one home, wrapping past the table's end)
are found through the widening windows, a batch whose ids claim the same free position places
them all, and an index laid out one id at a time (as earlier versions saved it) still serves. A
direct index tells a batch's new ids apart without a sort, leaving its held slots as they were."""

import numpy as np

import pytest

from elastic_step.ps.arrays import put_rows
from elastic_step.ps.index import EMPTY, DirectIndex, IdIndex


def ids_homed_at(index: IdIndex, home: int, count: int, seed: int = 0) -> np.ndarray:
    """`count` distinct ids whose home position in `index` is `home` (drawn until found)."""
    rng = np.random.default_rng(seed)
    found: list[int] = []
    while len(found) < count:
        candidates = rng.integers(-(1 << 62), 1 << 62, 200_000)
        found.extend(candidates[index._home(candidates) == home].tolist())
    return np.unique(np.array(found[:count], dtype=np.int64))[:count]


def one_at_a_time(ids: np.ndarray, bits: int) -> np.ndarray:
    """A reference layout: each id in turn at the first free position from its home."""
    index = IdIndex()
    index.bits, index.slots = bits, np.full(1 << bits, EMPTY, np.int32)
    for slot, home in enumerate(index._home(ids).tolist()):
        while index.slots[home] != EMPTY:
            home = (home + 1) % len(index.slots)
        index.slots[home] = slot
    return index.slots


def test_a_chain_longer_than_every_window_that_wraps_past_the_end_is_found_whole():
    index = IdIndex(200)  # 512 positions: room for a 60-long chain without growing
    last = len(index.slots) - 1
    chained = ids_homed_at(index, last, 60)  # one home, the last position: the chain wraps to 0..58
    others = ids_homed_at(index, 3, 5, seed=1)  # homed inside the wrapped chain: they probe past it
    ids = np.concatenate([chained, others])
    slot_ids = ids.copy()
    index.insert(ids, np.arange(len(ids)), slot_ids)  # one batch: all 60 claim the same first position
    assert len(index.slots) == 512 and index.count == len(ids)
    np.testing.assert_array_equal(index.find(ids, slot_ids), np.arange(len(ids)))
    absent = ids_homed_at(index, last, 70, seed=2)[60:]
    absent = absent[~np.isin(absent, ids)]
    assert len(absent) and (index.find(absent, slot_ids) == EMPTY).all()


def test_an_index_laid_out_one_id_at_a_time_still_finds_and_takes_new_ids():
    rng = np.random.default_rng(5)
    ids = np.unique(rng.integers(0, 1 << 40, 3000))
    bits = 13  # 8192 positions, 3000 held: below the 0.7 load
    index = IdIndex.from_slots(one_at_a_time(ids, bits), len(ids))
    slot_ids = np.concatenate([ids, np.zeros(2000, np.int64)])
    np.testing.assert_array_equal(index.find(ids, slot_ids), np.arange(len(ids)))
    more = np.setdiff1d(np.unique(rng.integers(0, 1 << 40, 2000)), ids)
    slot_ids[len(ids) : len(ids) + len(more)] = more
    index.insert(more, np.arange(len(ids), len(ids) + len(more)), slot_ids)
    everything = np.concatenate([ids, more])
    np.testing.assert_array_equal(index.find(everything, slot_ids), np.arange(len(everything)))


def test_a_direct_index_finds_the_distinct_new_ids_of_a_batch_with_repeats_and_keeps_its_slots():
    index = DirectIndex(1000)
    held = np.array([3, 500, 999])
    index.insert(held, np.arange(3), held)
    before = index.slots.copy()
    rng = np.random.default_rng(4)
    batch = rng.choice(np.setdiff1d(np.arange(1000), held), 300)  # repeats likely
    distinct, inverse = index.distinct(batch)
    assert sorted(distinct.tolist()) == sorted(set(batch.tolist()))  # each new id once
    assert np.array_equal(distinct[inverse], batch)  # every position names its id
    assert np.array_equal(index.slots, before)  # the marks are gone, the held slots untouched


def test_a_direct_index_refuses_ids_outside_its_table_before_marking_any_slot():
    index = DirectIndex(10)
    index.insert(np.array([9]), np.array([0]), np.array([9]))
    with pytest.raises(ValueError, match="outside the table's declared 10 rows"):
        index.distinct(np.array([2, -1]))  # -1 would have marked id 9's slot
    assert index.slots[9] == 0 and (index.slots[:9] == EMPTY).all()


def test_rows_put_at_scattered_positions_land_whole_as_indexing_puts_them():
    rng = np.random.default_rng(5)
    block = rng.random((50, 7), dtype=np.float32)
    expected = block.copy()
    positions, rows = rng.permutation(50)[:20], rng.random((20, 7), dtype=np.float32)
    expected[positions] = rows
    put_rows(block, positions, rows)
    assert np.array_equal(block, expected)
    put_rows(block, positions[:0], rows[:0])  # an empty part changes nothing
    assert np.array_equal(block, expected)
