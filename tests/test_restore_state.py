"""The master restores the group when every worker holding the model dies, driven directly (no
processes; test_restore_e2e.py runs real ones): the dispatcher and the ledger go back to the
newest handed-over checkpoint, or to the job's start while there is none (warm start kept), and
the relaunched rank 0 is told to load that state. The audit then holds every row exactly once."""

import threading
import time

from elastic_step.audit import read_audit
from elastic_step.backends.api import WorkerExit
from elastic_step.master.dispatcher import Dispatcher
from elastic_step.master.events import EventLog
from elastic_step.master.ledger import Consumed, Ledger
from elastic_step.master.restore import InitialState, RestorePoint
from elastic_step.master.state import MasterState, Timeouts
from elastic_step.protocol import RangeRecord, StepRecord, this_engine

from test_master_state import SPEC, RecordingBackend, join_all

ROWS, PER_TASK = 32, 4  # one epoch of eight tasks
HELD: dict = {}  # (state, round) -> what each member holds, across train() calls


def make_state(tmp_path, restore_point, checkpoints: list, max_relaunches: int = 3):
    dispatcher = Dispatcher([ROWS], ["f1"], rows_per_task=PER_TASK, epochs=1, shuffle=False)
    backend = RecordingBackend()
    ledger = Ledger(dispatcher, str(tmp_path / "audit.jsonl"))
    state = MasterState(SPEC, dispatcher, ledger, backend, EventLog(None), 1, 2, max_relaunches,
                        timeouts=Timeouts(heartbeat_s=60, rendezvous_s=60, startup_grace_s=60),
                        on_checkpoint=lambda *pair: checkpoints.append(pair), restore_point=restore_point)
    state.launch_all()
    start_round(state, backend.launched)
    return state, backend


def start_round(state, workers):
    """Fresh workers register and call in; the master proposes their round, which settles."""
    for worker_id in workers:
        state.register(worker_id, pid=1, host="h", engine=this_engine())
        state.rendezvous(worker_id, -1, [], 0)
    state.tick()
    return join_all(state)


def train(state, steps: int, first_step: int = 1, checkpoint_at: int | None = None):
    """`steps` steps of two rows per rank, rank 0 reporting them (and a checkpoint's state)."""
    round_id, members = state.round.id, state.round.members
    held = HELD.setdefault((id(state), round_id), {})  # member -> [its task, rows of it consumed]
    records = []
    for step in range(first_step, first_step + steps):
        ranges = []
        for member in members:
            if member not in held or held[member][1] >= held[member][0].count:
                held[member] = [state.next_task(member, round_id).task, 0]
            task, offset = held[member]
            ranges.append(RangeRecord(task_id=task.id, offset=offset, count=2))
            held[member][1] += 2
        records.append(StepRecord(step=step, ranges=ranges, samples=4, loss=1.0, time=time.time(),
                                  checkpoint=step == checkpoint_at))
    for record in records:  # one report per step, as rank 0's reporter sends them
        state.report_steps(members[0], round_id, [record])
        if record.checkpoint:
            state.checkpoint_state(members[0], round_id, record.step, b"state at %d" % record.step)
    state.tick()


def kill_everyone(state, backend):
    """SIGKILL every worker of the round; the master relaunches each slot."""
    dead = list(state.round.members)
    backend.exits.extend(WorkerExit(w, "killed by SIGKILL", -9) for w in dead)
    state.tick()
    return [w for w in backend.launched if w not in dead and state.workers[w].state.value == "launched"]


def finish(state):
    """The restored group applies every row still to do, then rank 0 hands in the model."""
    while not state.dispatcher.finished:
        train(state, 1, first_step=state.ledger.applied_step + 1)
    assert state.upload_model(state.round.members[0], state.ledger.applied_step, b"model")
    state.ledger.write_audit()


def worker_rows(state) -> dict:
    """Each worker's rows_applied, as /status (and so `get`) shows it."""
    return {w["id"]: w["rows_applied"] for w in state.status()["workers"]}


def assert_exact(tmp_path):
    counts = [0] * ROWS
    for entry in read_audit(str(tmp_path / "audit.jsonl")):
        for row in range(entry["start"], entry["start"] + entry["count"]):
            counts[row] += 1
    assert counts == [1] * ROWS, counts


def test_every_holder_dead_after_a_checkpoint_the_group_goes_on_from_it_exactly(tmp_path):
    handed = []
    state, backend = make_state(tmp_path, RestorePoint(0, None), handed)
    train(state, 3, checkpoint_at=2)  # steps 1..3; step 2's checkpoint is handed once step 3 makes it final
    assert [pair[0] for pair in handed] == [2]
    train(state, 2, first_step=4)  # steps 4, 5 (4 final): rows applied after the checkpoint
    dead = list(state.round.members)
    assert worker_rows(state) == {w: 10 for w in dead}  # two rows a step each, steps 1..5
    relaunched = kill_everyone(state, backend)
    replies = start_round(state, relaunched)
    ready = state.round
    # Each dead worker keeps its share of the checkpoint's steps only: steps 3..5 are trained again.
    assert worker_rows(state) == {**{w: 4 for w in dead}, **{w: 0 for w in ready.members}}
    assert ready.ready and ready.start_step == 2 and ready.source_rank == 0
    assert replies[ready.members[0]].initial_state == "checkpoint"
    assert state.initial_state.data == b"state at 2"  # what /initial-state hands rank 0
    assert state.ledger.applied_step == state.ledger.final_step == 2
    assert state.dispatcher.epoch_progress() == (8, ROWS)  # steps 3..5's rows are back in the queue
    restored = state.events.of("restored")
    assert [(e["step"], e["steps_lost"]) for e in restored] == [(2, 3)]
    assert "3 steps are lost" in restored[0]["message"]
    finish(state)
    assert state.state.value == "succeeded"
    assert state.ledger.rows_final == ROWS  # what result.json's rows_audited says
    assert sum(worker_rows(state).values()) == ROWS  # what `get` shows per worker adds up to it
    assert_exact(tmp_path)


def test_every_holder_dead_while_a_checkpoint_is_written_the_group_goes_on_from_that_checkpoint(tmp_path):
    """The newest checkpoint is still being written (off the lock) when every holder dies: the
    relaunched round waits for it, then goes on from it. Restoring the older point at once would
    leave the newer one, of the voided steps, to become the restore point when written."""
    handed, release = [], threading.Event()

    def record(*pair):
        if pair[0] == 4:
            release.wait(10)
        handed.append(pair)

    state, backend = make_state(tmp_path, RestorePoint(0, None), [])
    state.checkpoints.on_checkpoint = record
    state.lock.writes.wait_s = 0.05  # the calls below do not wait for the slow write
    train(state, 3, checkpoint_at=2)
    train(state, 3, first_step=4, checkpoint_at=4)  # step 4's checkpoint handed over once 5 is final: its write waits
    relaunched = kill_everyone(state, backend)
    start_round(state, relaunched)
    assert not state.round.ready and not state.events.of("restored")  # waiting for the checkpoint being written
    release.set()
    state.lock.writes.flush()
    join_all(state)
    assert state.round.ready and state.round.start_step == 4 and state.initial_state.data == b"state at 4"
    assert [(e["step"], e["steps_lost"]) for e in state.events.of("restored")] == [(4, 2)]
    assert [pair[0] for pair in handed] == [2, 4]
    finish(state)
    assert_exact(tmp_path)


def test_every_holder_dead_before_any_checkpoint_the_group_starts_over_exactly(tmp_path):
    state, backend = make_state(tmp_path, RestorePoint(0, None), [])
    train(state, 3)
    replies = start_round(state, kill_everyone(state, backend))
    assert state.round.start_step == 0 and all(r.initial_state == "" for r in replies.values())
    assert state.dispatcher.epoch_progress() == (0, ROWS)
    assert [(e["step"], e["steps_lost"]) for e in state.events.of("restored")] == [(0, 3)]
    finish(state)
    assert_exact(tmp_path)


def test_a_warm_started_job_starts_over_from_its_warm_start_model(tmp_path):
    warm = InitialState("model", b"warm model", 0)
    state, backend = make_state(tmp_path, RestorePoint(0, warm), [])
    assert state.round.start_step == 0
    train(state, 3)
    replies = start_round(state, kill_everyone(state, backend))
    assert replies[state.round.members[0]].initial_state == "model"
    assert state.initial_state.data == b"warm model"
    finish(state)
    assert_exact(tmp_path)


def test_the_last_survivor_dead_before_its_joiner_had_the_state_the_group_goes_on_from_the_checkpoint(tmp_path):
    state, backend = make_state(tmp_path, RestorePoint(0, None), [])
    train(state, 3, checkpoint_at=2)
    survivor, victim = state.round.members
    backend.exits.append(WorkerExit(victim, "killed by SIGKILL", -9))
    state.tick()  # the victim's slot is relaunched; the survivor trains on alone
    state.rendezvous(survivor, 3, [], state.round.id)
    state.tick()
    join_all(state, steps={survivor: 3})
    train(state, 2, first_step=4)
    joiner = [w for w in backend.launched if state.workers[w].state.value == "launched"]
    state.register(joiner[0], pid=1, host="h", engine=this_engine())
    state.rendezvous(joiner[0], -1, [], 0)
    state.tick()  # a round of the survivor and its joiner is proposed; the survivor dies before it settles
    assert sorted(state.round.members) == sorted([survivor, joiner[0]]) and not state.round.ready
    backend.exits.append(WorkerExit(survivor, "killed by SIGKILL", -9))
    state.tick()
    start_round(state, [w for w in backend.launched if state.workers[w].state.value == "launched"])
    assert state.round.ready and state.round.start_step == 2
    assert [e["step"] for e in state.events.of("restored")] == [2]
    finish(state)
    assert_exact(tmp_path)


def test_max_relaunches_still_bounds_a_group_that_keeps_dying(tmp_path):
    state, backend = make_state(tmp_path, RestorePoint(0, None), [], max_relaunches=1)
    train(state, 3, checkpoint_at=2)
    start_round(state, kill_everyone(state, backend))
    assert state.events.of("restored") and not state.over
    train(state, 2, first_step=3)
    kill_everyone(state, backend)  # no slot has a relaunch left
    assert state.state.value == "failed" and "--max-relaunches 1" in state.failure


def test_without_a_restore_point_the_job_fails_saying_why(tmp_path):
    # A PS-mode job: its shards hold part of the model and cannot go back with the ledger.
    state, backend = make_state(tmp_path, None, [])
    train(state, 3, checkpoint_at=2)
    start_round(state, kill_everyone(state, backend))
    assert state.state.value == "failed"
    assert "no state to restore" in state.failure and "--resume" in state.failure


def test_start_over_hands_out_the_same_tasks_as_a_new_dispatcher():
    fresh = Dispatcher([10, 7], ["a", "b"], rows_per_task=3, epochs=2, seed=4)
    used = Dispatcher([10, 7], ["a", "b"], rows_per_task=3, epochs=2, seed=4)
    for _ in range(4):
        task = used.next_task("w")
        used.mark_applied(task.id, 0, task.count)
    used.next_task("w")  # one in flight
    used.start_over()
    assert used.epoch_progress() == (0, 34) and not used.holder
    pieces = lambda d: [(t.epoch, t.shard, t.start, t.count) for t in iter(lambda: d.next_task("w"), None)]  # noqa: E731
    assert pieces(used) == pieces(fresh)


def test_a_voided_or_restored_step_no_longer_counts_in_its_workers_rows():
    dispatcher = Dispatcher([ROWS], ["f1"], rows_per_task=PER_TASK, epochs=1, shuffle=False)
    ledger = Ledger(dispatcher)
    tasks = {w: dispatcher.next_task(w) for w in ("a", "b")}
    for step in (1, 2):  # two rows a step from each worker's task
        ledger.ingest(step, [Consumed(tasks[w].id, 2 * (step - 1), 2) for w in "ab"], ["a", "b"])
    assert ledger.worker_rows() == {"a": 4, "b": 4} and ledger.worker_rows(1) == {"a": 2, "b": 2}
    ledger.void_after(1)  # a regroup settles at step 1: step 2 is trained again
    assert ledger.worker_rows() == {"a": 2, "b": 2}
    ledger.resume_from(0, 0, {"a": 1})  # a restore to a checkpoint at which a alone had rows
    assert ledger.worker_rows() == {"a": 1}


class FakeShards:
    """A mode ps job's shards as master/ps_rollback.py sees them (the real ones: test_ps_rollback.py,
    test_cluster_ps.py): roll_back records what it was asked, or fails as told."""

    def __init__(self, state, fails: Exception | None = None):
        import threading

        self.state, self.fails, self.asked = state, fails, []
        self.scaling, self.rolling_back = threading.Lock(), threading.Event()
        self.supervisor, self.followed = self, 0

    def roll_back(self, lost: int, cut: dict, fence: int) -> None:
        # Meanwhile the regroup's round is proposed and called in to, but does not settle, and no
        # checkpoint is taken (PsCheckpoints refuses while rolling back).
        self.state.tick()
        join_all(self.state, steps={m: 5 for m in self.state.round.members})
        self.asked.append((lost, cut, fence, self.state.round.ready, self.rolling_back.is_set()))
        if self.fails:
            raise self.fails

    def follow(self) -> None:
        self.followed += 1


def ps_job(tmp_path):
    """A mode ps job's state: each checkpoint's ledger holds the shards' cut (as PsCheckpoints puts it there)."""
    from elastic_step.master.ps_checkpoints import PS_CUT

    def record(step, epoch, state, ledger):
        ledger[PS_CUT] = {"step": step, "digests": ["d0", "d1"]}

    state, backend = make_state(tmp_path, RestorePoint(0, None), [])
    state.checkpoints.on_checkpoint = record
    return state, backend


def test_a_ps_rollback_holds_every_round_until_the_shards_are_back_then_the_live_group_goes_on_from_the_checkpoint(tmp_path):
    """A shard's rows lost (its pod deleted): master/ps_rollback.py fences the rounds so far, no
    round settles while the shards go back to the newest checkpoint's cut, then the live workers
    (none died, none is relaunched) go on from it, and the audit holds every row once."""
    from elastic_step.master.ps_rollback import PsRollback, roll_back_on_loss

    state, backend = ps_job(tmp_path)
    shards = FakeShards(state)
    roll_back_on_loss(types_namespace(supervisor=shards), state)
    assert PsRollback(state, shards)(1) is False  # no checkpoint yet: nothing to go back to (the shard is DOWN)
    assert state.rounds.rollback is None and not state.over
    train(state, 3, checkpoint_at=2)
    train(state, 2, first_step=4)
    old = state.round.id
    launched = list(backend.launched)
    state.tick()
    assert PsRollback(state, shards)(1) is True
    ((lost, cut, fence, settled, refusing),) = shards.asked
    assert (lost, cut["step"], fence, settled, refusing) == (1, 2, old, False, True)
    assert shards.followed == 1 and not shards.rolling_back.is_set()
    state.tick()
    replies = join_all(state, steps={m: 5 for m in state.round.members}, left=old)
    ready = state.round
    assert ready.ready and ready.id > fence and ready.start_step == 2 and ready.source_rank == 0
    assert replies[ready.members[0]].initial_state == "checkpoint" and state.initial_state.data == b"state at 2"
    assert state.ledger.applied_step == state.ledger.final_step == 2
    assert state.dispatcher.epoch_progress() == (8, ROWS)  # steps 3..5's rows are back in the queue
    (restored,) = state.events.of("restored")
    assert (restored["step"], restored["steps_lost"]) == (2, 3)
    assert restored["message"].startswith("parameter-server shard 1's pod was deleted")
    assert "checkpoint of step 2" in restored["message"]
    assert backend.launched == launched  # no worker restarted
    finish(state)
    assert_exact(tmp_path)


def test_a_ps_rollback_that_cannot_be_done_fails_the_job_in_one_line(tmp_path):
    from elastic_step.master.ps_rollback import PsRollback
    from elastic_step.ps.api import PsError

    state, _ = ps_job(tmp_path)
    train(state, 3, checkpoint_at=2)
    state.tick()
    shards = FakeShards(state, fails=PsError("shard 0 refused its rollback: no cut of step 2"))
    assert PsRollback(state, shards)(1) is False
    assert state.state.value == "failed" and len(state.failure.splitlines()) == 1
    assert "shard 1's pod was deleted" in state.failure and "no cut of step 2" in state.failure and "--resume" in state.failure
    assert not shards.rolling_back.is_set()


def test_every_holder_dead_in_a_ps_job_still_fails_saying_why(tmp_path):
    # Its shards hold every acknowledged push: they go back only through a rollback, never with the ledger alone.
    from elastic_step.master.ps_rollback import roll_back_on_loss

    state, backend = ps_job(tmp_path)
    roll_back_on_loss(None, state)
    train(state, 3, checkpoint_at=2)
    start_round(state, kill_everyone(state, backend))
    assert state.state.value == "failed" and "no state to restore" in state.failure


def types_namespace(**fields):
    import types

    return types.SimpleNamespace(**fields)
