"""The dispatcher and the ledger, without processes."""

import json

import pytest

from elastic_step.errors import JobFailed
from elastic_step.master.dispatcher import Dispatcher, cut_tasks
from elastic_step.master.ledger import Consumed, Ledger, StepGap


def ranges(tasks):
    return [(t.shard, t.start, t.start + t.count) for t in tasks]


def drain(dispatcher, worker="w"):
    tasks = []
    while (task := dispatcher.next_task(worker)) is not None:
        tasks.append(task)
    return tasks


def apply_all(dispatcher, ledger, tasks, step=0):
    for task in tasks:
        step += 1
        ledger.ingest(step, [Consumed(task.id, 0, task.count)])
    return step


def test_two_shards_of_ten_rows_in_three_row_tasks_make_eight_tasks():
    d = Dispatcher([10, 10], ["f1", "f2"], rows_per_task=3, epochs=1, shuffle=False)
    tasks = drain(d)
    assert ranges(tasks) == [(0, 0, 3), (0, 3, 6), (0, 6, 9), (0, 9, 10), (1, 0, 3), (1, 3, 6), (1, 6, 9), (1, 9, 10)]
    assert cut_tasks([10, 10], 3) == [(s, a, b - a) for s, a, b in ranges(tasks)]


def test_failed_task_returns_to_todo_and_is_handed_out_next():
    d = Dispatcher([10], ["f1"], rows_per_task=3, epochs=1, shuffle=False)
    first = d.next_task("a")
    d.next_task("a")
    d.return_task(first.id, failed=True, reason="boom")
    again = d.next_task("b")
    assert (again.start, again.count, again.failures) == (first.start, first.count, 1)


def test_a_task_that_keeps_failing_fails_the_job_naming_shard_and_rows():
    d = Dispatcher([10], ["train/part-00000.parquet"], rows_per_task=3, epochs=1, shuffle=False, max_task_failures=3)
    task = d.next_task("a")
    d.return_task(task.id, failed=True)
    d.next_task("a")
    d.return_task(task.id, failed=True)
    d.next_task("a")
    with pytest.raises(JobFailed, match=r"train/part-00000.parquet rows \[0, 3\)"):
        d.return_task(task.id, failed=True, reason="bad row")


def test_dead_workers_tasks_are_recovered_and_only_theirs_count_failures():
    d = Dispatcher([12], ["f1"], rows_per_task=3, epochs=1, shuffle=False)
    a, b = d.next_task("alive"), d.next_task("dead")
    assert d.return_all({"dead"}) == 2
    again = drain(d)
    assert sorted(ranges(again)) == [(0, 0, 3), (0, 3, 6), (0, 6, 9), (0, 9, 12)]
    failures = {t.start: t.failures for t in again}
    assert failures[b.start] == 1 and failures[a.start] == 0


def test_partially_applied_task_returns_only_its_remainder():
    d = Dispatcher([10], ["f1"], rows_per_task=6, epochs=1, shuffle=False)
    ledger = Ledger(d)
    task = d.next_task("a")
    ledger.ingest(1, [Consumed(task.id, 0, 2)])
    d.return_all({"a"})
    rest = d.next_task("b")
    assert (rest.start, rest.count) == (2, 4)


def test_two_epochs_repeat_the_ranges_and_the_job_finishes(tmp_path):
    audit = tmp_path / "audit.jsonl"
    d = Dispatcher([10, 10], ["f1", "f2"], rows_per_task=3, epochs=2, shuffle=True, seed=7)
    ledger = Ledger(d, str(audit))
    first = [d.next_task("w") for _ in range(8)]
    assert {t.epoch for t in first} == {0}
    second = drain(d)  # while epoch 0 is in flight, epoch 1 is handed out already
    assert {t.epoch for t in second} == {1} and len(second) == 8
    assert d.next_task("w") is None and not d.finished  # and no further than one epoch ahead
    step = apply_all(d, ledger, first)
    assert sorted(ranges(second)) == sorted(ranges(first))
    assert ranges(second) != ranges(first)  # shuffled per epoch
    apply_all(d, ledger, second, step)
    assert d.finished
    ledger.finalize_through(ledger.applied_step)
    lines = [json.loads(line) for line in audit.read_text().splitlines()]
    for epoch in (0, 1):
        rows = sorted((l["shard"], r) for l in lines if l["epoch"] == epoch for r in range(l["start"], l["start"] + l["count"]))
        assert rows == sorted((f, r) for f in ("f1", "f2") for r in range(10))


def test_ledger_voids_tentative_steps_and_their_rows_go_back():
    d = Dispatcher([6], ["f1"], rows_per_task=6, epochs=1, shuffle=False)
    ledger = Ledger(d)
    task = d.next_task("a")
    ledger.ingest(1, [Consumed(task.id, 0, 2)])
    ledger.ingest(2, [Consumed(task.id, 2, 2)])
    ledger.ingest(3, [Consumed(task.id, 4, 2)])
    assert d.finished
    assert ledger.final_step == 2  # step 3 may still be undone by a regroup
    assert ledger.void_after(2) == 2
    assert not d.finished
    d.return_all()
    rest = d.next_task("b")
    assert (rest.start, rest.count) == (4, 2)


def test_ledger_rejects_gaps_repeats_and_ranges_that_do_not_continue():
    d = Dispatcher([6], ["f1"], rows_per_task=6, epochs=1, shuffle=False)
    ledger = Ledger(d)
    task = d.next_task("a")
    with pytest.raises(StepGap):
        ledger.ingest(2, [Consumed(task.id, 0, 2)])
    assert ledger.ingest(1, [Consumed(task.id, 0, 2)])
    assert not ledger.ingest(1, [Consumed(task.id, 0, 2)])  # a repeated report changes nothing
    with pytest.raises(ValueError):
        ledger.ingest(2, [Consumed(task.id, 3, 2)])
    assert d.tasks[task.id].applied == 2


def test_voided_step_that_completed_an_epoch_reopens_it():
    d = Dispatcher([3], ["f1"], rows_per_task=3, epochs=2, shuffle=False)
    ledger = Ledger(d)
    task = d.next_task("a")
    ledger.ingest(1, [Consumed(task.id, 0, 3)])
    assert d.current_epoch == 1
    ledger.void_after(0)
    assert d.current_epoch == 0
    d.return_all()
    assert d.next_task("b").epoch == 0


def test_memory_stays_bounded_to_open_epochs():
    d = Dispatcher([30], ["f1"], rows_per_task=3, epochs=5, shuffle=False)
    ledger = Ledger(d)
    step = 0
    for _ in range(5):
        step = apply_all(d, ledger, drain(d), step)
        assert len(d.tasks) <= 40  # at most four epochs of ten tasks
    assert d.finished


def test_snapshot_and_restore_keep_applied_rows_and_return_the_rest():
    d = Dispatcher([10, 10], ["f1", "f2"], rows_per_task=4, epochs=2, shuffle=False)
    ledger = Ledger(d)
    a, b = d.next_task("w"), d.next_task("w")
    ledger.ingest(1, [Consumed(a.id, 0, 4), Consumed(b.id, 0, 2)])
    snapshot = d.snapshot()
    d.next_task("w")  # handed out after the checkpoint: must come back
    restored = Dispatcher([10, 10], ["f1", "f2"], rows_per_task=4, epochs=2, shuffle=False)
    restored.restore(json.loads(json.dumps(snapshot)))
    assert restored.epoch_progress() == (6, 40)
    todo = drain(restored)
    assert sorted(ranges(t for t in todo if t.epoch == 0)) == [(0, 6, 8), (0, 8, 10), (1, 0, 4), (1, 4, 8), (1, 8, 10)]


def test_a_million_tasks_are_implicit_in_the_shard_sizes_and_cost_under_100_bytes_each():
    import tracemalloc

    tracemalloc.start()
    d = Dispatcher([1000] * 1000, [f"part-{i:05d}" for i in range(1000)], rows_per_task=1, epochs=1, shuffle=True)
    ledger = Ledger(d)
    apply_all(d, ledger, [d.next_task("w") for _ in range(10_000)])
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak / 1_000_000 <= 100, f"{peak / 1_000_000:.0f} bytes per task"
    assert d.epoch_progress() == (10_000, 1_000_000)


def test_finished_tasks_let_go_as_objects_are_still_known_snapshotted_and_voidable(monkeypatch):
    import elastic_step.master.dispatcher as dispatcher

    monkeypatch.setattr(dispatcher, "FINISHED_KEPT", 0)  # every finished task's object goes at once
    d = Dispatcher([10, 7], ["f1", "f2"], rows_per_task=3, epochs=2, shuffle=True, seed=3)
    ledger = Ledger(d)
    first, second, third = d.next_task("a"), d.next_task("a"), d.next_task("b")
    ledger.ingest(1, [Consumed(first.id, 0, first.count), Consumed(third.id, 0, 1)])
    ledger.ingest(2, [Consumed(second.id, 0, second.count)])
    assert d.tasks[first.id].applied == first.count and (d.tasks[first.id].shard, d.tasks[first.id].start) == (first.shard, first.start)
    assert ledger.void_after(1) == second.count  # a let-go task put back in flight by a voided step
    assert d.tasks[second.id].applied == 0
    d.return_all()  # `third` splits: its applied row stays, the rest goes back
    restored = Dispatcher([10, 7], ["f1", "f2"], rows_per_task=3, epochs=2, shuffle=True, seed=3)
    restored.restore(json.loads(json.dumps(d.snapshot())))
    assert restored.epoch_progress() == d.epoch_progress() == (first.count + 1, 34)
    left = sorted((t.shard, r) for t in drain(restored) if t.epoch == 0 for r in range(t.start, t.start + t.count))
    done = {(first.shard, r) for r in range(first.start, first.start + first.count)} | {(third.shard, third.start)}
    assert left == sorted({(s, r) for s, n in enumerate([10, 7]) for r in range(n)} - done)
