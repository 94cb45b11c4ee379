"""How a rank takes its rows and how a fixed global batch is shared out (worker/rows.py)."""

import numpy as np
import pytest

from elastic_step.protocol import RangeRecord, StepRecord, TaskInfo, TaskStatus
from elastic_step.worker.rows import TaskRows, merged, shares


def tasks_of(*counts, then=TaskStatus.WAIT):
    """A take_task that hands out tasks of these sizes (rows numbered across tasks), then `then`."""
    answers, first = [], 0
    for i, count in enumerate(counts):
        features = np.arange(first, first + count, dtype=np.float32)[:, None]
        answers.append((TaskStatus.TASK, TaskInfo(id=i, epoch=0, shard=0, start=first, count=count),
                        (features, features[:, 0].astype(np.int64))))
        first += count
    calls = iter(answers)
    return lambda: next(calls, (then, None, None))


@pytest.mark.parametrize("rows, eligible, expected", [
    (10, [True, True, True], [4, 3, 3]),
    (2, [True, True, True], [1, 1, 0]),  # fewer rows than ranks: the last rank is empty
    (7, [False, True, False, True], [0, 4, 0, 3]),
    (0, [True, True], [0, 0]),
    (5, [False, False], [0, 0]),
])
def test_shares_split_rows_evenly_over_the_eligible_ranks(rows, eligible, expected):
    assert shares(rows, eligible) == expected
    assert sum(expected) == (rows if any(eligible) else 0)


def test_a_rank_finishes_a_task_and_starts_the_next_within_one_take():
    rows = TaskRows(tasks_of(5, 5, 5))
    pieces = rows.take(7, max_pieces=4)
    assert [(p.task_id, p.offset, p.count) for p in pieces] == [(0, 0, 5), (1, 0, 2)]
    assert np.concatenate([p.labels for p in pieces]).tolist() == list(range(7))
    pieces = rows.take(6, max_pieces=4)
    assert [(p.task_id, p.offset, p.count) for p in pieces] == [(1, 2, 3), (2, 0, 3)]
    assert not rows.ran_out


def test_take_stops_at_max_pieces_and_when_the_master_has_nothing_now():
    rows = TaskRows(tasks_of(2, 2, 2, 2))
    assert [p.count for p in rows.take(100, max_pieces=3)] == [2, 2, 2]
    assert not rows.ran_out  # it stopped at the pieces' limit: it may have more
    assert [p.count for p in rows.take(100, max_pieces=3)] == [2]
    assert rows.ran_out and rows.status == TaskStatus.WAIT
    assert rows.take(5, max_pieces=3) == [] and rows.ran_out


def test_one_piece_per_take_is_the_per_worker_minibatch():
    rows = TaskRows(tasks_of(5, 5))
    assert [(p.task_id, p.count) for p in rows.take(4, 1)] == [(0, 4)]
    assert [(p.task_id, p.count) for p in rows.take(4, 1)] == [(0, 1)]  # the task's short tail, as before
    assert [(p.task_id, p.count) for p in rows.take(4, 1)] == [(1, 4)]


def test_merged_joins_consecutive_ranges_of_a_task_only():
    ranges = [RangeRecord(task_id=3, offset=0, count=4), RangeRecord(task_id=3, offset=4, count=2),
              RangeRecord(task_id=5, offset=0, count=1), RangeRecord(task_id=5, offset=2, count=1)]
    assert [(r.task_id, r.offset, r.count) for r in merged(ranges)] == [(3, 0, 6), (5, 0, 1), (5, 2, 1)]


def test_a_step_record_carries_one_range_several_or_none_per_rank():
    record = StepRecord(step=1, samples=9, loss=1.0, time=1.0, ranges=[
        {"task_id": 1, "offset": 0, "count": 4}, None,
        [{"task_id": 2, "offset": 3, "count": 1}, {"task_id": 4, "offset": 0, "count": 4}]])
    assert isinstance(record.ranges[0], RangeRecord) and record.ranges[1] is None
    assert [r.task_id for r in record.ranges[2]] == [2, 4]
    with pytest.raises(ValueError):
        StepRecord(step=1, samples=0, loss=0.0, time=1.0, ranges=[[]])  # an empty list is not "no data"
