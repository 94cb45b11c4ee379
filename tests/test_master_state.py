"""The master's state machine driven directly: rounds, settling, hung workers. The backend here
is a recorder (no processes), since these tests are about the master's decisions; the
end-to-end tests run real processes."""

import time

from elastic_step.backends.api import Backend, WorkerExit
from elastic_step.master.dispatcher import Dispatcher
from elastic_step.master.events import EventLog
from elastic_step.master.ledger import Ledger
from elastic_step.master.state import MasterState, Timeouts
from elastic_step.protocol import JobSpec, RangeRecord, StepRecord, this_engine


class RecordingBackend(Backend):
    name = "recording"

    def __init__(self):
        self.launched, self.stopped, self.exits = [], [], []

    def launch(self, slot, worker_id):
        self.launched.append(worker_id)

    def poll(self):
        exits, self.exits = self.exits, []
        return exits

    def stop(self, worker_id):
        self.stopped.append(worker_id)
        self.exits.append(WorkerExit(worker_id, "killed by SIGKILL", -9))

    def shutdown(self, grace_s, members=None):
        pass


SPEC = JobSpec(job_name="t", model_def="m", manifest="d", minibatch_size=2, seed=0, store_host="127.0.0.1",
               store_port=1, collective_timeout_s=5, heartbeat_interval_s=0.1, master_timeout_s=5, features=[], label="y")


def make_state(workers=3, minimum=2, heartbeat_s=10.0, rendezvous_s=30.0):
    dispatcher = Dispatcher([12], ["f1"], rows_per_task=4, epochs=1, shuffle=False)
    backend = RecordingBackend()
    state = MasterState(SPEC, dispatcher, Ledger(dispatcher), backend, EventLog(None), minimum, workers,
                        timeouts=Timeouts(heartbeat_s=heartbeat_s, rendezvous_s=rendezvous_s, startup_grace_s=30))
    state.launch_all()
    for worker_id in backend.launched:
        state.register(worker_id, pid=1, host="h", engine=this_engine())
    state.tick()
    return state, backend


def join_all(state, steps=None, unacked=None, left=0):
    replies = {}
    for _ in range(2):  # the last member to call in completes the round
        for i, member in enumerate(state.round.members):
            replies[member] = state.rendezvous(member, (steps or {}).get(member, -1), (unacked or {}).get(member, []), left)
    return replies


def test_first_round_forms_when_all_workers_registered_and_ranks_follow_slots():
    state, backend = make_state()
    assert state.round.members == ["w0.1", "w1.1", "w2.1"]
    replies = join_all(state)
    assert [replies[m].rank for m in state.round.members] == [0, 1, 2]
    assert all(r.status == "ready" and r.world_size == 3 for r in replies.values())


def test_hung_worker_is_dropped_after_heartbeat_timeout_and_its_task_returns():
    state, backend = make_state(heartbeat_s=0.2)
    join_all(state)
    held = state.next_task("w2.1", state.round.id).task
    for _ in range(5):
        time.sleep(0.06)
        state.heartbeat("w0.1", 0)
        state.heartbeat("w1.1", 0)
        state.tick()
    assert "w2.1" in backend.stopped
    assert "w2.1" not in state.round.members
    assert "w2.2" in backend.launched  # the slot is relaunched
    join_all(state, steps={"w0.1": 0, "w1.1": 0})
    again = [state.next_task("w0.1", state.round.id).task for _ in range(3)]
    assert any(t.start == held.start and t.count == held.count for t in again)


def test_settle_takes_steps_from_the_state_source_and_voids_later_ones():
    state, backend = make_state()
    join_all(state)
    round_id = state.round.id
    t0 = state.next_task("w0.1", round_id).task
    t1 = state.next_task("w1.1", round_id).task
    step1 = StepRecord(step=1, ranges=[RangeRecord(task_id=t0.id, offset=0, count=2), RangeRecord(task_id=t1.id, offset=0, count=2), None], samples=4, loss=1.0, time=time.time())
    step2 = StepRecord(step=2, ranges=[RangeRecord(task_id=t0.id, offset=2, count=2), None, None], samples=2, loss=1.0, time=time.time())
    # rank 0 reported both steps, then died; the survivors only completed step 1
    state.report_steps("w0.1", round_id, [step1, step2])
    assert state.ledger.applied_step == 2
    backend.exits.append(WorkerExit("w0.1", "killed by SIGKILL", -9))
    state.tick()
    join_all(state, steps={"w1.1": 1, "w2.1": 1}, unacked={"w1.1": [step1], "w2.1": [step1]}, left=round_id)
    assert state.round.ready and state.round.start_step == 1
    assert state.ledger.applied_step == 1 and state.ledger.final_step == 1
    assert state.dispatcher.tasks[t0.id].applied == 2  # step 2's rows went back


def test_a_paused_master_blames_no_worker_for_the_silence_and_still_drops_a_hung_one():
    # A VM pause or snapshot stops the master and its workers alike; on resume, the master's
    # next tick comes late and no worker has been heard from for that long.
    state, backend = make_state(heartbeat_s=0.2)
    join_all(state)
    time.sleep(0.3)  # the whole machine is paused: no ticks, no heartbeats
    state.tick()
    assert backend.stopped == []
    assert state.events.of("master_paused")[0]["seconds"] >= 0.3
    for _ in range(5):  # after the pause, w2.1 really is silent
        time.sleep(0.06)
        state.heartbeat("w0.1", 0)
        state.heartbeat("w1.1", 0)
        state.tick()
    assert backend.stopped == ["w2.1"]


def test_a_paused_master_restarts_the_rendezvous_clock_and_still_drops_a_member_that_never_joins():
    state, backend = make_state(heartbeat_s=0.2, rendezvous_s=0.3)
    for member in ("w0.1", "w1.1"):  # w2.1 registered but has not called in to the round yet
        state.rendezvous(member, -1, [], 0)
    time.sleep(0.4)  # the whole machine is paused, past the rendezvous timeout
    state.tick()
    assert backend.stopped == []
    for _ in range(8):  # after the pause, everyone heartbeats but w2.1 never joins the round
        time.sleep(0.06)
        for worker_id in ("w0.1", "w1.1", "w2.1"):
            state.heartbeat(worker_id, 0)
        state.tick()
    assert backend.stopped == ["w2.1"]
    assert "did not join round" in state.events.of("dropped")[0]["message"]


def test_status_reports_the_newest_mean_loss_and_samples_per_second():
    state, backend = make_state()
    join_all(state)
    round_id = state.round.id
    t0, t1, t2 = (state.next_task(m, round_id).task for m in state.round.members)
    ranges = lambda offset: [RangeRecord(task_id=t.id, offset=offset, count=2) for t in (t0, t1, t2)]  # noqa: E731
    state.report_steps("w0.1", round_id, [StepRecord(step=1, ranges=ranges(0), samples=6, loss=6.0, time=100.0),
                                          StepRecord(step=2, ranges=ranges(2), samples=6, loss=3.0, time=100.5)])
    status = state.status()
    assert status["loss"] == 0.5 and status["samples_per_s"] == 12.0


def test_a_dropped_worker_whose_exit_is_slow_to_come_is_dropped_and_stopped_once():
    # The backend reports a stopped worker's exit only when it sees it (a pod's delete, a watch
    # event): until then the worker is as absent at the rendezvous, or as silent, as before.
    state, backend = make_state(heartbeat_s=0.3, rendezvous_s=0.2)
    backend.stop = backend.stopped.append  # stopping is asked; no exit comes back yet
    for member in ("w0.1", "w1.1"):  # w2.1 never calls in to the round, and stops heartbeating
        state.rendezvous(member, -1, [], 0)
    deadline = time.monotonic() + 1.2  # four heartbeat timeouts, many rendezvous timeouts
    while time.monotonic() < deadline:
        time.sleep(0.05)
        for worker_id in ("w0.1", "w1.1"):
            state.heartbeat(worker_id, 0)
        state.tick()
    assert backend.stopped == ["w2.1"]
    assert [e["worker"] for e in state.events.of("dropped")] == ["w2.1"]
    assert "did not join round" in state.events.of("dropped")[0]["message"]


def test_a_smaller_groups_first_step_counts_as_its_recovery_even_when_it_arrives_with_the_joiners_round():
    # A fast replacement can join before rank 0's report of the smaller group's first step goes
    # out: that step then reaches the master as the state source's unacknowledged step when the
    # joiner's round settles. It is still the smaller group's recovery, and the job says so.
    state, backend = make_state()
    join_all(state)
    first = state.round.id
    backend.exits.append(WorkerExit("w2.1", "killed by SIGKILL", -9))
    state.tick()
    join_all(state, steps={"w0.1": 0, "w1.1": 0}, left=first)
    smaller = state.round
    assert smaller.ready and smaller.members == ["w0.1", "w1.1"]
    t0 = state.next_task("w0.1", smaller.id).task
    t1 = state.next_task("w1.1", smaller.id).task
    step = StepRecord(step=smaller.start_step + 1, ranges=[RangeRecord(task_id=t0.id, offset=0, count=2),
                                                           RangeRecord(task_id=t1.id, offset=0, count=2)],
                      samples=4, loss=1.0, time=time.time())
    assert "w2.2" in backend.launched
    state.register("w2.2", pid=2, host="h", engine=this_engine())
    state.rendezvous("w2.2", -1, [], 0)
    state.tick()
    join_all(state, steps={"w0.1": step.step, "w1.1": step.step}, unacked={"w0.1": [step], "w1.1": [step]}, left=smaller.id)
    assert state.round.ready and len(state.round.members) == 3 and state.round.start_step == step.step
    assert state.ledger.applied_step == step.step
    recovered = state.events.of("recovered")
    assert [(e["round"], e["step_time"]) for e in recovered] == [(smaller.id, step.time)], recovered


def test_a_loss_whose_round_never_trained_is_recovered_by_the_round_that_took_over():
    # The replacement joins before the survivors call in for the smaller round: a round with it
    # takes over, and its first step is the recovery from the SIGKILL (not a plain join's round,
    # which recovers from nothing). Forked replacements join in ~0.2 s, so this is the usual order.
    state, backend = make_state()
    join_all(state)
    first = state.round.id
    killed_at = time.time()
    backend.exits.append(WorkerExit("w2.1", "killed by SIGKILL", -9))
    state.tick()
    smaller = state.round
    assert not smaller.ready and smaller.members == ["w0.1", "w1.1"]
    state.register("w2.2", pid=2, host="h", engine=this_engine())
    state.rendezvous("w2.2", -1, [], 0)
    state.tick()
    took_over = state.round
    assert took_over.id == smaller.id + 1 and len(took_over.members) == 3
    join_all(state, steps={"w0.1": 0, "w1.1": 0}, left=first)
    assert state.round.ready
    tasks = [state.next_task(w, took_over.id).task for w in took_over.members]
    step = StepRecord(step=took_over.start_step + 1, ranges=[RangeRecord(task_id=t.id, offset=0, count=2) for t in tasks],
                      samples=6, loss=1.0, time=time.time())
    state.report_steps(took_over.members[0], took_over.id, [step])
    recovered = state.events.of("recovered")
    assert [(e["round"], e["cause"]) for e in recovered] == [(took_over.id, "w2.1 killed by SIGKILL")], recovered
    assert killed_at - 1e-3 <= step.time - recovered[0]["seconds"] <= time.time()  # from the loss, not the join (seconds: 4 places)


def test_a_step_every_member_says_it_holds_is_final_before_the_next_one_is_reported():
    # The audit shows a round's first step (the recovery, seen from outside) once every member's
    # heartbeat says it applied it, not a whole step later when rank 0 reports the second.
    state, _ = make_state()
    join_all(state)
    ready = state.round
    tasks = [state.next_task(w, ready.id).task for w in ready.members]
    step = StepRecord(step=ready.start_step + 1, ranges=[RangeRecord(task_id=t.id, offset=0, count=2) for t in tasks],
                      samples=6, loss=1.0, time=time.time())
    state.report_steps(ready.members[0], ready.id, [step])
    assert state.ledger.final_step == ready.start_step  # reported by rank 0 alone: the others may not hold it
    state.heartbeat("w0.1", step.step, round_id=ready.id)
    state.heartbeat("w1.1", step.step, round_id=ready.id)
    state.heartbeat("w2.1", step.step, round_id=ready.id - 1)  # a beat of an older round says nothing of this one
    state.heartbeat("w2.1", ready.start_step, round_id=ready.id)  # nor one from before the round's first collective
    assert state.ledger.final_step == ready.start_step
    reply = state.heartbeat("w2.1", step.step, round_id=ready.id)
    assert state.ledger.final_step == step.step and state.ledger.rows_final == 6
    assert reply.acked_step == step.step  # the members may forget its ranges
    state.heartbeat("w0.1", step.step + 5, round_id=ready.id)  # ahead of what rank 0 reported: final stops there
    assert state.ledger.final_step == step.step

    # The beats can come before rank 0's report (it sends in batches): the report then makes it final.
    for member in ready.members:
        state.heartbeat(member, step.step + 1, round_id=ready.id)
    second = StepRecord(step=step.step + 1, ranges=[RangeRecord(task_id=t.id, offset=2, count=2) for t in tasks],
                        samples=6, loss=1.0, time=time.time())
    assert state.report_steps(ready.members[0], ready.id, [second]) == second.step
    assert state.ledger.rows_final == 12


def test_a_worker_still_warming_up_is_hung_only_after_the_warm_up_allowance():
    # Registered, not yet called in to a round: importing TensorFlow on a busy node can starve its
    # heartbeat thread for longer than the heartbeat timeout, and that is no hang.
    state, backend = make_state(heartbeat_s=0.2)
    state.timeouts.warm_up_s = 1.0
    started = time.monotonic()
    while time.monotonic() - started < 0.6:
        time.sleep(0.05)
        state.heartbeat("w0.1", -1)
        state.heartbeat("w1.1", -1)
        state.tick()
    assert backend.stopped == []  # 3x the heartbeat timeout of silence, still warming up
    while time.monotonic() - started < 1.4:
        time.sleep(0.05)
        state.heartbeat("w0.1", -1)
        state.heartbeat("w1.1", -1)
        state.tick()
    assert backend.stopped == ["w2.1"]
    assert "warming up" in state.events.of("dropped")[0]["message"]
