"""SIGTERM in the master's state machine: a preemption asks rank 0 for a checkpoint of its next step
as the operator's stop does, but within its own deadline and ending PREEMPTED; a preemption while
a stop waits takes the sooner deadline; with nothing to checkpoint the job ends PREEMPTED at once."""

from __future__ import annotations

import threading
import time

from elastic_step.protocol import JobState

from test_stop import started, train


def test_a_preemption_waits_for_a_checkpoint_of_a_later_step_then_ends_preempted():
    state, handed = started()
    train(state, 1, checkpoint=True)
    state.preempt(timeout_s=60)
    assert state.checkpoint_now and state.state == JobState.RUNNING
    train(state, 2)  # step 1's older checkpoint is handed over: not the preemption's
    state.tick()
    assert handed == [1] and state.state == JobState.RUNNING
    train(state, 3, checkpoint=True)
    train(state, 4)
    state.tick()
    assert handed == [1, 3] and state.state == JobState.PREEMPTED and state.failure == ""
    assert [e["step"] for e in state.events.of("preempted")] == [3] and not state.events.of("stopped")
    assert state.heartbeat("w1.1", 4).action == "stop"


def test_without_a_checkpoint_in_time_the_job_ends_preempted_saying_so():
    state, _ = started()
    train(state, 1)
    state.preempt(timeout_s=0.0)
    time.sleep(0.01)
    state.tick()
    assert state.state == JobState.PREEMPTED and "no checkpoint after step 1" in state.failure
    assert "SIGTERM" in state.failure


def test_a_checkpoint_still_being_written_at_the_deadline_decides_the_preemption_once_written():
    """The supervision loop ticks on while a checkpoint is written (a parameter-server cut, an
    upload): the deadline passing meanwhile must not end the job as if no checkpoint had come."""
    release = threading.Event()
    state, handed = started(record=lambda step: release.wait(10))
    state.lock.writes.wait_s = 0.05  # the tick does not wait for the write
    train(state, 1)
    state.preempt(timeout_s=0.3)
    train(state, 2, checkpoint=True)
    train(state, 3)
    state.tick()  # step 2's checkpoint handed over: its write waits
    time.sleep(0.4)
    state.tick()  # past the deadline, the write still under way
    assert handed == [2] and state.state == JobState.RUNNING
    release.set()
    state.lock.writes.flush()
    assert state.state == JobState.PREEMPTED and state.failure == ""
    assert [e["step"] for e in state.events.of("preempted")] == [2]


def test_a_preemption_while_a_stop_waits_ends_preempted_by_the_sooner_deadline():
    state, _ = started()
    state.request_stop()  # the operator's: five minutes
    state.preempt(timeout_s=0.0)
    assert len(state.events.of("stop_requested")) == 1
    time.sleep(0.01)
    state.tick()
    assert state.state == JobState.PREEMPTED


def test_a_job_without_checkpoints_ends_preempted_at_once():
    state, _ = started(checkpoints=False)
    state.preempt(timeout_s=60)
    assert state.state == JobState.PREEMPTED and "--checkpoint-steps 0" in state.failure
    state.preempt(timeout_s=60)  # a second SIGTERM changes nothing
    assert len(state.events.of("preempted")) == 1


def test_what_ends_a_job_after_its_sigterm_ends_it_preempted_not_failed():
    state, _ = started()
    train(state, 1)
    state.preempt(timeout_s=60)
    state.fail("every worker that held the model state of step 1 is gone")  # its workers were drained too
    assert state.state == JobState.PREEMPTED and "no checkpoint after the SIGTERM: every worker" in state.failure
    assert not state.events.of("job_failed")


def test_a_preemption_whose_workers_all_leave_too_ends_at_once():
    from elastic_step.backends.api import WorkerExit

    state, _ = started()
    train(state, 1)
    state.preempt(timeout_s=60)
    members = list(state.ready_round.members)
    state.on_exit(WorkerExit(members[0], "left on SIGTERM (exited with code 143)", 143, relaunch="free", left=True))
    assert state.state == JobState.RUNNING  # one member still holds the model: its checkpoint may come
    state.on_exit(WorkerExit(members[1], "left on SIGTERM (exited with code 143)", 143, relaunch="free", left=True))
    assert state.state == JobState.PREEMPTED and "left too" in state.failure  # a node drain: nothing to wait for
