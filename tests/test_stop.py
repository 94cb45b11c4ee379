"""The graceful stop in the master's state machine: rank 0 is asked to checkpoint its next step,
the job is STOPPED once that checkpoint is handed over (an older one does not count), a job
without checkpoints refuses, and rank 0's step reporter turns the request into one checkpoint."""

from __future__ import annotations

import pytest

from elastic_step.master import stopping
from elastic_step.master.dispatcher import Dispatcher
from elastic_step.master.events import EventLog
from elastic_step.master.ledger import Ledger
from elastic_step.master.state import MasterState, Timeouts
from elastic_step.protocol import JobState, RangeRecord, StepRecord, this_engine
from elastic_step.worker.background import StepReporter

from test_master_state import SPEC, RecordingBackend, join_all


def started(checkpoints: bool = True, record=None):
    """A running job of two workers; `record(step)` is called for each checkpoint handed over
    (after it is appended to the list returned)."""
    handed = []

    def on_checkpoint(step, epoch, data, ledger):
        handed.append(step)
        if record is not None:
            record(step)

    dispatcher = Dispatcher([64], ["f1"], rows_per_task=4, epochs=1, shuffle=False)
    backend = RecordingBackend()
    state = MasterState(SPEC, dispatcher, Ledger(dispatcher), backend, EventLog(None), 2, 2,
                        timeouts=Timeouts(startup_grace_s=30), on_checkpoint=on_checkpoint if checkpoints else None)
    state.launch_all()
    for worker_id in backend.launched:
        state.register(worker_id, pid=1, host="h", engine=this_engine())
    state.tick()
    join_all(state)
    assert state.ready_round is not None
    return state, handed


def train(state: MasterState, step: int, checkpoint: bool = False) -> None:
    tasks = [state.next_task(m, state.ready_round_id).task for m in state.ready_round.members]
    record = StepRecord(step=step, ranges=[RangeRecord(task_id=t.id, offset=0, count=t.count) for t in tasks],
                        samples=sum(t.count for t in tasks), loss=1.0, time=float(step), checkpoint=checkpoint)
    state.report_steps("w0.1", state.ready_round_id, [record])
    if checkpoint:
        state.checkpoint_state("w0.1", state.ready_round_id, step, b"state")


def test_a_stop_waits_for_a_checkpoint_after_the_request_then_stops():
    state, handed = started()
    train(state, 1, checkpoint=True)
    state.request_stop()
    assert state.checkpoint_now and state.status()["stopping"]
    train(state, 2)  # the older checkpoint of step 1 becomes final and is handed over: not the stop's
    state.tick()
    assert handed == [1] and state.state == JobState.RUNNING
    train(state, 3, checkpoint=True)
    assert not state.checkpoint_now  # rank 0 flagged a step: asked once
    state.tick()
    assert state.state == JobState.RUNNING  # step 3 is not final yet
    train(state, 4)
    state.tick()
    assert handed == [1, 3] and state.state == JobState.STOPPED
    assert state.events.of("stopped")[0]["step"] == 3 and state.over
    assert state.heartbeat("w1.1", 4).action == "stop"
    with pytest.raises(ValueError, match="has ended"):
        state.request_stop()


def test_asking_twice_is_one_stop():
    state, _ = started()
    state.request_stop()
    state.request_stop()
    assert len(state.events.of("stop_requested")) == 1


def test_a_job_without_checkpoints_refuses_a_stop():
    state, _ = started(checkpoints=False)
    with pytest.raises(ValueError, match="takes no checkpoints"):
        state.request_stop()
    assert state.stop_request is None and state.state == JobState.RUNNING


def test_without_a_checkpoint_in_time_the_job_stops_saying_so(monkeypatch):
    monkeypatch.setattr(stopping, "STOP_CHECKPOINT_TIMEOUT_S", 0.0)
    state, _ = started()
    state.request_stop()
    state.tick()
    assert state.state == JobState.STOPPED and "no checkpoint after step 0" in state.failure


def test_the_reporter_turns_one_request_into_one_checkpoint():
    reporter = StepReporter(client=None, worker_id="w0.1")
    reporter._take_reply({"acked_step": 1, "epoch": 0})
    assert not reporter.checkpoint_requested
    reporter._take_reply({"acked_step": 2, "epoch": 0, "checkpoint_now": True})
    assert reporter.checkpoint_requested  # the worker checkpoints its next step
    reporter.checkpoint_requested = False  # (what the worker does when it takes it)
    reporter._take_reply({"acked_step": 3, "epoch": 0, "checkpoint_now": True})  # the same request, still open
    assert not reporter.checkpoint_requested
    reporter._take_reply({"acked_step": 4, "epoch": 1})  # an epoch's end still makes its own checkpoint
    assert reporter.epoch == 1 and not reporter.checkpoint_requested
    reporter._take_reply({"acked_step": 5, "epoch": 1, "checkpoint_now": True})  # a new request
    assert reporter.checkpoint_requested
