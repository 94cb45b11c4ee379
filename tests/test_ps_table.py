"""An embedding table on a shard: rows created alike on any shard, the id index exact through its
growth, per-row SGD / Adagrad / Adam updates equal to torch.optim's on the touched rows, and a
row that costs at most 1.35x its payload."""

import os

import numpy as np
import pytest
import torch

from elastic_step.ps.api import OptimizerKind, TableSpec
from elastic_step.ps.ledger import Ledger, LedgerRecord, encode, replay
from elastic_step.ps.table import EmbeddingTable

pytestmark = pytest.mark.usefixtures("ledgers_closed")  # conftest.py: no ledger left open

DIM = 8


def pushes(rows: int, steps: int, per_step: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = np.unique(rng.integers(0, rows, per_step))
        yield ids, rng.normal(size=(len(ids), DIM)).astype(np.float32)


def torch_reference(spec: TableSpec, rows: int, steps: list) -> np.ndarray:
    """The same pushes applied by torch.optim to a dense weight: an untouched row gets a zero
    gradient, which SGD and Adagrad leave unchanged."""
    table = EmbeddingTable(spec)
    weight = torch.nn.Parameter(torch.from_numpy(table.pull(np.arange(rows)).copy()))
    if spec.optimizer is OptimizerKind.SGD:
        optimizer = torch.optim.SGD([weight], lr=spec.lr)
    elif spec.optimizer is OptimizerKind.ADAGRAD:
        optimizer = torch.optim.Adagrad([weight], lr=spec.lr, eps=spec.eps, initial_accumulator_value=spec.initial_accumulator)
    else:
        optimizer = torch.optim.Adam([weight], lr=spec.lr, betas=(spec.beta1, spec.beta2), eps=spec.eps)
    for ids, grads in steps:
        dense = torch.zeros(rows, DIM)
        dense[torch.from_numpy(ids)] = torch.from_numpy(grads)
        weight.grad = dense
        optimizer.step()
    return weight.detach().numpy()


@pytest.mark.parametrize("optimizer", [OptimizerKind.SGD, OptimizerKind.ADAGRAD])
def test_sparse_rows_match_torch_dense(optimizer):
    spec = TableSpec("t", DIM, optimizer, lr=0.1, initial_accumulator=0.1)
    steps = list(pushes(rows=300, steps=40, per_step=50))
    table = EmbeddingTable(spec)
    for ids, grads in steps:
        table.push(ids, grads)
    np.testing.assert_allclose(table.pull(np.arange(300)), torch_reference(spec, 300, steps), rtol=1e-5, atol=1e-6)


def test_adam_matches_torch_when_every_row_is_touched():
    """Lazy Adam counts each row's own updates; where every push touches every row that count
    is torch's global step, so the two must agree."""
    spec = TableSpec("t", DIM, OptimizerKind.ADAM, lr=0.01, eps=1e-8)
    rng = np.random.default_rng(1)
    steps = [(np.arange(40), rng.normal(size=(40, DIM)).astype(np.float32)) for _ in range(30)]
    table = EmbeddingTable(spec)
    for ids, grads in steps:
        table.push(ids, grads)
    np.testing.assert_allclose(table.pull(np.arange(40)), torch_reference(spec, 40, steps), rtol=1e-5, atol=1e-6)


def test_lazy_adam_matches_a_per_row_numpy_reference():
    spec = TableSpec("t", DIM, OptimizerKind.ADAM, lr=0.01, eps=1e-8)
    steps = list(pushes(rows=200, steps=30, per_step=40, seed=2))
    table = EmbeddingTable(spec)
    w = table.pull(np.arange(200)).astype(np.float64)
    m, v, t = np.zeros_like(w), np.zeros_like(w), np.zeros(200)
    for ids, grads in steps:
        table.push(ids, grads)
        t[ids] += 1
        m[ids] = 0.9 * m[ids] + 0.1 * grads
        v[ids] = 0.999 * v[ids] + 0.001 * grads.astype(np.float64) ** 2
        step_size = 0.01 / (1 - 0.9 ** t[ids])[:, None]
        w[ids] -= step_size * m[ids] / (np.sqrt(v[ids]) / np.sqrt(1 - 0.999 ** t[ids])[:, None] + 1e-8)
    np.testing.assert_allclose(table.pull(np.arange(200)), w, rtol=1e-4, atol=1e-6)
    assert table.counters() == {i: int(c) for i, c in enumerate(t) if c}


def test_rows_are_created_alike_on_any_shard_and_repeated_ids_are_summed():
    spec = TableSpec("t", DIM, seed=7)
    one, other = EmbeddingTable(spec), EmbeddingTable(spec)
    ids = np.array([5, 3, 1 << 40, -2])
    other.pull(np.arange(1000))  # a different history of creations
    np.testing.assert_array_equal(one.pull(ids), other.pull(ids))
    assert not np.array_equal(one.pull(ids), EmbeddingTable(TableSpec("t", DIM, seed=8)).pull(ids))
    grads = np.ones((3, DIM), np.float32)
    one.push(np.array([5, 5, 3]), grads)
    other.push(np.array([5, 3]), np.array([2 * grads[0], grads[0]]))
    np.testing.assert_array_equal(one.pull(ids), other.pull(ids))
    assert one.counters()[5] == 1


def test_the_index_stays_exact_through_growth():
    table = EmbeddingTable(TableSpec("t", 2, OptimizerKind.SGD))
    rng = np.random.default_rng(3)
    expected = {}
    for _ in range(30):
        ids = rng.integers(-(1 << 62), 1 << 62, 3000) if rng.random() < 0.5 else rng.integers(0, 20000, 3000)
        slots = table.slots_of(ids)
        for i, s in zip(ids.tolist(), slots.tolist()):
            assert expected.setdefault(i, s) == s
    assert table.size == len(expected)
    assert sorted(table.ids[: table.size].tolist()) == sorted(expected)


def test_a_shard_table_past_its_indexs_int32_slots_is_refused_in_one_line_and_keeps_its_rows(monkeypatch):
    from elastic_step.ps import index

    monkeypatch.setattr(index, "MAX_ROWS", 1000)  # 2**31 - 1 rows of a real table: the same check
    table = EmbeddingTable(TableSpec("t", 2, OptimizerKind.SGD))
    table.slots_of(np.arange(900))
    with pytest.raises(OverflowError, match="at most 1,000 rows of one table .* run more shards"):
        table.slots_of(np.arange(900, 1200))
    assert table.size == table.index.count == 900 and (table.slots_of(np.arange(900)) == np.arange(900)).all()


def test_a_row_costs_at_most_1_35x_its_payload():
    """dim 16 + Adagrad: 128 bytes of weights and accumulator. The table reserves its declared
    share of rows (TableSpec.rows), as a shard of a declared table does."""
    rows = 300_000
    table = EmbeddingTable(TableSpec("t", 16, OptimizerKind.ADAGRAD, rows=rows), reserve=rows)
    for start in range(0, rows, 50_000):
        table.pull(np.arange(start, start + 50_000) * 7919 % rows)  # every id of [0, rows) once, spread
    payload = 2 * 16 * 4
    assert table.size == rows
    assert table.nbytes / rows <= 1.35 * payload


def test_a_reserved_table_fills_without_moving_its_rows_and_equals_a_growing_one():
    """A shard of a declared table reserves its share up front: filling it never copies the block
    (a growth would), and every row, slot and counter is what a table that grew holds."""
    spec = TableSpec("t", DIM, OptimizerKind.ADAGRAD, rows=4000)
    reserved, growing = EmbeddingTable(spec, reserve=4000), EmbeddingTable(spec)
    block = reserved.block
    for ids, grads in pushes(rows=4000, steps=20, per_step=400):
        for table in (reserved, growing):
            table.pull(ids)
            table.push(ids, grads)
    assert reserved.block is block and reserved.size > 3000
    assert reserved.digest() == growing.digest()


def test_a_push_reuses_its_pulls_slots_only_while_they_hold_its_ids():
    """A push of the ids a pull fetched reuses the pull's slots; a caller that reuses the pulled
    ids' buffer, or a table whose rows were reloaded (load, drop) since, gets the right rows."""
    spec = TableSpec("t", DIM, OptimizerKind.SGD, lr=1.0)
    table, reference = EmbeddingTable(spec), EmbeddingTable(spec)
    grads = np.ones((3, DIM), np.float32)
    buffer = np.array([10, 20, 30])
    table.pull(buffer)
    buffer[:] = [40, 20, 10]  # a server reusing its receive buffer for the next request
    table.pull(np.arange(50))
    table.push(buffer, grads)
    reference.push(np.array([40, 20, 10]), grads)
    probe = np.arange(50)
    np.testing.assert_array_equal(table.pull(probe), reference.pull(probe))
    pulled = np.array([45, 46, 47])
    table.pull(pulled)
    table.drop(np.isin(table.ids[: table.size], [0, 1, 2]))  # rows 3 onwards take new slots
    reference.drop(np.isin(reference.ids[: reference.size], [0, 1, 2]))
    table.push(pulled, grads)
    reference.push(pulled, grads)
    assert table.digest() == reference.digest()


def test_dropping_moved_rows_keeps_every_other_row_as_it_was_in_its_reserved_block():
    spec = TableSpec("t", DIM, OptimizerKind.ADAGRAD, rows=5000)
    table = EmbeddingTable(spec, reserve=5000)
    for ids, grads in pushes(rows=5000, steps=10, per_step=800):
        table.push(ids, grads)
    gone = np.random.default_rng(5).random(table.size) < 0.4
    kept, dropped = table.where(~gone), table.where(gone)["ids"]
    block = table.block
    table.drop(gone)
    assert table.block is block and table.size == len(kept["ids"])  # in place: no second copy of the table
    reference = EmbeddingTable(spec)
    reference.load(**kept)
    assert table.digest() == reference.digest()
    assert (table.index.find(dropped, table.ids) == -1).all()  # forgotten: a pull would make them anew
    np.testing.assert_array_equal(table.pull(kept["ids"]), kept["rows"][:, :DIM])


def test_a_relaunched_shard_reads_its_snapshot_into_its_reserved_block_without_a_second_copy(tmp_path):
    """Recovery maps the snapshot and copies it into the table's own (reserved) arrays: the
    memory it allocates at its peak is about the table's, not the table's plus the snapshot's."""
    import tracemalloc
    from contextlib import closing

    from elastic_step.ps.routing import RoutingTable
    from elastic_step.ps.state import ShardState

    spec = TableSpec("t", 16, OptimizerKind.ADAGRAD, rows=200_000)
    with closing(ShardState(str(tmp_path), [spec], 0, RoutingTable.initial(1), snapshot_every=10**9)) as state:
        state.recover()
        state.pull("t", np.arange(200_000))
        state.snapshot()
        digest = state.tables["t"].digest()
    with closing(ShardState(str(tmp_path), [spec], 0, RoutingTable.initial(1), snapshot_every=10**9)) as relaunched:
        tracemalloc.start()
        relaunched.recover()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        table = relaunched.tables["t"]
        assert table.digest() == digest and len(table.ids) >= 200_000  # its reservation, with room
        assert peak < 1.3 * table.nbytes, (peak, table.nbytes)


def test_snapshot_arrays_restore_an_equal_table():
    spec = TableSpec("t", DIM, OptimizerKind.ADAM)
    table = EmbeddingTable(spec)
    for ids, grads in pushes(rows=500, steps=5, per_step=100):
        table.push(ids, grads)
    saved = {k: v.copy() for k, v in table.arrays().items()}
    copy, rebuilt = EmbeddingTable(spec), EmbeddingTable(spec)
    copy.load(**{k: v.copy() for k, v in saved.items()})
    rebuilt.load(**{k: v.copy() for k, v in saved.items() if k != "index"})
    assert copy.digest() == rebuilt.digest() == table.digest()
    probe = np.arange(600)
    np.testing.assert_array_equal(copy.pull(probe), table.pull(probe))
    table.push(np.array([1]), np.ones((1, DIM), np.float32))
    assert copy.digest() != table.digest()
    with pytest.raises(ValueError, match="does not fit"):
        EmbeddingTable(spec).load(**{**saved, "index": saved["index"][:-1]})


def test_the_ledger_replays_whole_records_and_cuts_a_torn_tail(tmp_path):
    path = str(tmp_path / "ledger.bin")
    ledger = Ledger(path)
    records = [LedgerRecord("t", 1, b, 0, np.array([b, b + 1]), np.full((2, DIM), b, np.float32)) for b in range(3)]
    for record in records:
        ledger.append(record)
    ledger.file.write(encode(LedgerRecord("t", 1, 9, 0, np.array([1]), np.ones((1, DIM), np.float32)))[:-5])
    ledger.close()
    replayed = list(replay(path, lambda name: DIM))
    assert [(r.task, r.batch_seq) for r in replayed] == [(1, 0), (1, 1), (1, 2)]
    np.testing.assert_array_equal(replayed[2].grads, records[2].grads)
    assert len(list(replay(path, lambda name: DIM))) == 3  # the torn record is gone from the file


def test_a_ledger_record_the_disk_took_only_part_of_is_cut_and_the_next_one_replays(tmp_path, monkeypatch):
    """A full disk takes part of a record and the push fails: the part is cut off at once, so a
    record appended later (acknowledged) is not behind a torn one, where replay would stop."""
    from elastic_step.ps import ledger as ledger_module

    path = str(tmp_path / "ledger.bin")
    ledger = Ledger(path)
    first, lost, later = (LedgerRecord("t", 1, b, 0, np.array([b]), np.full((1, DIM), b, np.float32)) for b in range(3))
    ledger.append(first)
    real_writev = os.writev
    monkeypatch.setattr(ledger_module.os, "writev", lambda fd, parts: real_writev(fd, [bytes(parts[0])]))  # the header only
    with pytest.raises(OSError, match="written short .*disk full"):
        ledger.append(lost)
    monkeypatch.setattr(ledger_module.os, "writev", real_writev)
    ledger.append(later)
    ledger.close()
    assert [r.batch_seq for r in replay(path, lambda name: DIM)] == [0, 2]


def test_applied_keys_answer_as_a_set_would_and_survive_a_snapshot():
    from elastic_step.ps.applied import AppliedKeys

    rng = np.random.default_rng(4)
    keys, reference = AppliedKeys(), set()
    for _ in range(3000):  # mostly in order per task, some out of order and repeated
        task = int(rng.integers(0, 5))
        seq = int(rng.integers(0, 400)) if rng.random() < 0.2 else keys.below.get(task, 0)
        keys.add((task, seq))
        reference.add((task, seq))
    probes = [(t, s) for t in range(6) for s in range(450)]
    assert [p in keys for p in probes] == [p in reference for p in probes]
    assert len(keys) == len(reference)
    again = AppliedKeys.from_arrays(**keys.to_arrays())
    assert [p in again for p in probes] == [p in reference for p in probes]
    assert sum(len(s) for s in keys.above.values()) < len(reference) // 5  # the watermarks hold the rest


def test_a_declared_table_is_indexed_directly_and_an_id_outside_it_gets_a_zero_row_and_no_row_made():
    """ids in [0, rows) find their slot with one gather; an id outside (a feed that training
    would have refused) reads as a served model reads it, zeros, without taking a slot."""
    from elastic_step.ps.index import DirectIndex

    table = EmbeddingTable(TableSpec("t", 3, OptimizerKind.SGD, rows=100), reserve=60)
    assert isinstance(table.index, DirectIndex) and table.index.nbytes == 4 * 100
    rows = table.pull(np.array([5, -1, 99, 100, 7]))
    assert table.size == 3 and sorted(table.ids[:3].tolist()) == [5, 7, 99]
    assert (rows[[1, 3]] == 0).all() and (rows[[0, 2, 4]] != 0).any(axis=1).all()
    np.testing.assert_array_equal(table.pull(np.array([7, 5])), rows[[4, 0]])  # the same rows, found again
    with pytest.raises(ValueError, match="outside the table's declared 100 rows"):
        table.index.insert(np.array([100]), np.array([3]), table.ids)


def test_a_declared_tables_direct_index_is_not_saved_and_a_hash_index_saved_before_is_not_trusted():
    """A snapshot keeps no direct index (4 bytes per declared id on every shard): loading rebuilds
    it from the held ids. A snapshot written while the table had a hash index (before it was
    indexed directly) is loaded the same way, even where the hash index's length equals the
    declared rows (a power of two), which would otherwise read as a direct index."""
    from elastic_step.ps.index import IdIndex

    spec = TableSpec("t", 2, OptimizerKind.SGD, rows=1024)
    ids = np.array([3, 1023, 17, 512])
    fresh = EmbeddingTable(spec, reserve=563)
    expected = fresh.pull(ids)
    saved = {key: np.array(value) for key, value in fresh.arrays().items()}
    assert len(saved["index"]) == 0

    older = EmbeddingTable(spec, reserve=563)
    older.index = IdIndex(563)  # what the table had before: 1024 slots, as many as its declared ids
    older.pull(ids[::-1])
    old_saved = {key: np.array(value) for key, value in older.arrays().items()}
    assert len(old_saved["index"]) == spec.rows
    for arrays in (saved, old_saved):
        loaded = EmbeddingTable(spec, reserve=563)
        loaded.load(arrays["ids"], arrays["rows"], arrays["updates"], arrays["index"])
        np.testing.assert_array_equal(loaded.pull(ids), expected)
        assert loaded.size == 4


def test_a_ledger_record_with_no_ids_is_written_and_replayed(tmp_path):
    path = str(tmp_path / "ledger.bin")
    ledger = Ledger(path)
    ledger.append(LedgerRecord("t", 1, 0, 0, np.array([], np.int64), np.zeros((0, DIM), np.float32)))
    ledger.close()
    replayed, = replay(path, lambda name: DIM)
    assert len(replayed.ids) == 0 and replayed.grads.shape == (0, DIM)


def test_a_snapshot_holding_ids_past_the_declared_rows_is_refused_in_one_line_naming_the_table():
    """Rows a shard cannot index (a job resumed with a smaller rows=) are named, not an IndexError."""
    grown = EmbeddingTable(TableSpec("t", 2, OptimizerKind.SGD))
    grown.pull(np.array([3, 12]))
    saved = grown.arrays()
    with pytest.raises(ValueError, match="table 't' holds ids outside its declared 10 rows .* declare the rows="):
        EmbeddingTable(TableSpec("t", 2, OptimizerKind.SGD, rows=10)).load(saved["ids"], saved["rows"], saved["updates"])


@pytest.mark.parametrize("changed, refusal", [
    (TableSpec("t", 2, OptimizerKind.SGD, rows=10), r"holds pushes to table 't' with ids outside its declared 10 rows: declare the rows="),
    (TableSpec("u", 2, OptimizerKind.SGD, rows=100), r"holds pushes to table 't', which this job does not declare \(it declares 'u'\)"),
    (TableSpec("t", 3, OptimizerKind.SGD, rows=100), r"holds pushes to table 't' of dim 2, not the declared 3: declare the dim"),
])
def test_a_ledger_this_jobs_tables_cannot_take_is_refused_in_one_line_naming_the_table(tmp_path, changed, refusal):
    """A job resumed with another model definition (a smaller rows=, a renamed table, another dim) finds its
    shard's unsnapshotted pushes named, not an index or key error half-way through the replay."""
    from elastic_step.ps.routing import RoutingTable
    from elastic_step.ps.state import ShardState

    trained = ShardState(str(tmp_path), [TableSpec("t", 2, OptimizerKind.SGD, rows=100)], 0, RoutingTable.initial(1), sync=False)
    trained.recover()
    trained.push(LedgerRecord("t", 0, 0, 0, np.array([5, 50]), np.ones((2, 2), np.float32)))
    trained.close()
    with pytest.raises(ValueError, match=refusal):
        ShardState(str(tmp_path), [changed], 0, RoutingTable.initial(1), sync=False).recover()
