"""The exactly-once ledger under random interleavings (hypothesis, stateful).

The master's own objects (MasterState, Dispatcher, Ledger) run in process, driven by simulated
workers that behave as the real ones do (worker/loop.py): they fetch tasks, apply steps
together, rank 0 reports them in batches and checkpoints, every rank keeps its unacknowledged
steps, and a failed collective sends them back to rendezvous. Around them, the failures: torn
steps (some ranks applied, others not), deaths at any point (the state source's before its
broadcast, too), reports duplicated, reordered, late, and from dead or foreign workers, late
checkpoint uploads, and master restarts that resume from the newest checkpoint.

A simulated model is the sequence of steps applied to it, so the test sees what the product
promises: after every action, no row of any epoch is applied twice (in the audit and in any
worker's model), no row of a completed epoch is missing, every committed checkpoint pairs a
model with the ledger of that same model, and a finished job applied every row exactly once.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field

import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from elastic_step.audit import read_audit
from elastic_step.backends.api import WorkerExit
from elastic_step.master.dispatcher import Dispatcher
from elastic_step.master.events import EventLog
from elastic_step.master.ledger import Ledger
from elastic_step.master.restore import InitialState
from elastic_step.master.state import Conflict, MasterState, Refused, Timeouts
from elastic_step.protocol import JobSpec, RangeRecord, StepRecord, this_engine

from test_master_state import RecordingBackend

SHARDS = {"s0": 7, "s1": 5}
EPOCHS = 2
ROWS_PER_TASK = 3
MINIBATCH = 2
SPEC = JobSpec(job_name="p", model_def="m", manifest="d", minibatch_size=MINIBATCH, seed=0, store_host="127.0.0.1",
               store_port=1, collective_timeout_s=5, heartbeat_interval_s=0.1, master_timeout_s=5, features=[], label="y")

uids = itertools.count(1)


@dataclass
class Applied:
    """One step as every rank of its round applied it."""

    uid: int
    record: StepRecord
    rows: list[tuple[int, str, int, int]]  # (epoch, shard, first row, count) of every rank


@dataclass(eq=False)  # workers are told apart by identity
class SimWorker:
    id: str
    alive: bool = True
    registered: bool = False
    model: tuple[int, ...] = ()  # uids of the steps applied to its parameters, in order
    step: int = -1
    unacked: dict[int, StepRecord] = field(default_factory=dict)
    acked: int = 0
    round_id: int = 0  # the round it trains in (0: at rendezvous)
    rank: int = 0
    world_size: int = 0
    source_rank: int = 0
    start_step: int = 0
    initial: str = ""  # the source loads the master's initial state first
    joined: bool = False  # its round's state broadcast is done
    left_round: int = 0
    task: object = None
    offset: int = 0
    reports: list[tuple[int, StepRecord]] = field(default_factory=list)  # rank 0: not yet sent
    sent: list[tuple[int, StepRecord]] = field(default_factory=list)  # rank 0: sent (for resends)
    uploads: list[tuple[int, int, bytes]] = field(default_factory=list)  # rank 0: checkpoint states


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="ledger-")
        self.audit = os.path.join(self.dir, "audit.jsonl")
        self.applied: dict[int, Applied] = {}
        self.committed: list[tuple[int, bytes, dict]] = []  # (step, model, ledger) checkpoints
        self.masters = 0
        self.finished_model: tuple[int, ...] | None = None
        self._start_master(None)

    # -- the master ---------------------------------------------------------------------------
    def _start_master(self, checkpoint):
        self.masters += 1
        self.dispatcher = Dispatcher(list(SHARDS.values()), list(SHARDS), ROWS_PER_TASK, EPOCHS, shuffle=True, seed=3)
        self.ledger = Ledger(self.dispatcher, self.audit)
        initial = None
        if checkpoint is not None:
            step, model, snapshot = checkpoint
            self.dispatcher.restore(snapshot)
            self.ledger.resume_from(step)
            initial = InitialState("checkpoint", model, step)
        elif self.masters > 1:
            self.ledger.resume_from(0)  # nothing to resume from: every earlier entry is void
        self.backend = RecordingBackend()
        self.backend.stop = lambda worker_id: self._kill(worker_id)  # a dropped worker is killed
        self.state = MasterState(
            SPEC, self.dispatcher, self.ledger, self.backend, EventLog(None), 1, 3, max_relaunches=1000,
            timeouts=Timeouts(heartbeat_s=1e9, rendezvous_s=1e9, startup_grace_s=0),
            initial_state=initial, on_checkpoint=lambda step, epoch, state, ledger: self.committed.append((step, state, ledger)),
        )
        self.workers: dict[str, SimWorker] = {}
        self.state.launch_all()
        self._sync_launches()

    def _sync_launches(self):
        for worker_id in self.backend.launched:
            if worker_id not in self.workers:
                self.workers[worker_id] = SimWorker(worker_id)

    def _kill(self, worker_id):
        worker = self.workers.get(worker_id)
        if worker is not None and worker.alive:
            worker.alive = False
            self.backend.exits.append(WorkerExit(worker_id, "killed by SIGKILL", -9))

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except Refused:
            return None

    def _live(self):
        return [w for w in self.workers.values() if w.alive]

    def _round_members(self, round_id):
        return sorted((w for w in self._live() if w.round_id == round_id), key=lambda w: w.rank)

    def _leave_round(self, worker):
        if worker.round_id:
            self._call(self.state.collective_failed, worker.id, worker.round_id, "peer gone")
            worker.left_round, worker.round_id, worker.joined, worker.task = worker.round_id, 0, False, None

    # -- rules ----------------------------------------------------------------------------------
    @rule()
    def tick(self):
        self.state.tick()
        self._sync_launches()

    def _training_round(self) -> int:
        """The newest round whose members all hold its state (0: none)."""
        return max((w.round_id for w in self._live() if w.joined), default=0)

    @initialize()
    def first_round(self):
        self.rendezvous(source_dies=0)

    @rule(source_dies=st.integers(0, 5))
    def rendezvous(self, source_dies):
        """Workers register, the master ticks; every live worker not training calls in (twice: the last member to
        call in completes the round); a ready round's source broadcasts its state, or (drawn
        one time in six) dies before its broadcast reached anyone."""
        for worker in self._live():
            if not worker.registered:
                try:
                    worker.registered = self.state.register(worker.id, 1, "h", this_engine()) is not None
                except Conflict:  # launched no more (its slot was given up on): it must stop
                    pass
        self.tick()
        for _ in range(2):
            for worker in self._live():
                if not worker.registered or worker.round_id:
                    continue
                for step in [s for s in worker.unacked if s <= worker.acked]:
                    del worker.unacked[step]
                reply = self.state.rendezvous(worker.id, worker.step, list(worker.unacked.values()), worker.left_round)
                if reply.status in ("stop", "done"):
                    self._kill(worker.id)  # it exits
                elif reply.status == "ready":
                    worker.round_id, worker.rank, worker.world_size, worker.joined, worker.task = (
                        reply.round_id, reply.rank, reply.world_size, False, None)
                    worker.source_rank, worker.start_step, worker.initial = (
                        reply.source_rank, reply.start_step, reply.initial_state)
        for round_id in {w.round_id for w in self._live() if w.round_id and not w.joined}:
            members = self._round_members(round_id)
            if len(members) != members[0].world_size:
                continue  # not every member has its reply yet
            source = members[members[0].source_rank]
            if source_dies == 5:
                self._kill(source.id)
                for worker in members:
                    self._leave_round(worker)
                continue
            if source.initial:
                source.model = json_model(self.state.initial_state.data)
            for worker in members:
                worker.model, worker.step, worker.joined = source.model, worker.start_step, True
                worker.unacked.clear()

    @precondition(lambda self: self._training_round())
    @rule(n=st.integers(1, 10), torn=st.booleans(), checkpoint_every=st.sampled_from([0, 1, 2]), data=st.data())
    def train(self, n, torn, checkpoint_every, data):
        """n steps of the newest round in which every member has the state; the last one torn
        (applied by some ranks only, then one rank dies), if so drawn."""
        round_id = self._training_round()
        members = self._round_members(round_id)
        if not members or not all(w.joined for w in members):
            return
        for i in range(n):
            if any(not w.alive or w.round_id != round_id for w in members):
                return
            for worker in members:
                if worker.task is None or worker.offset >= worker.task.count:
                    reply = self.state.next_task(worker.id, round_id)
                    worker.task, worker.offset = (reply.task, 0) if reply.status == "task" else (None, 0)
                    if reply.status == "regroup":
                        for w in members:
                            self._leave_round(w)
                        return
            taking = [(w, min(MINIBATCH, w.task.count - w.offset)) if w.task else (w, 0) for w in members]
            if all(count == 0 for _, count in taking):
                return self._finish(members)
            ranges = [RangeRecord(task_id=w.task.id, offset=w.offset, count=c) if c else None for w, c in taking]
            rows = [(w.task.epoch, list(SHARDS)[w.task.shard], w.task.start + w.offset, c) for w, c in taking if c]
            step = members[0].step + 1
            record = StepRecord(step=step, ranges=ranges, samples=sum(c for _, c in taking), loss=1.0, time=1.0,
                                checkpoint=bool(checkpoint_every) and step % checkpoint_every == 0)
            applied = Applied(next(uids), record, rows)
            self.applied[applied.uid] = applied
            last_torn = torn and i == n - 1
            appliers = data.draw(st.sets(st.sampled_from(members), min_size=1)) if last_torn else members
            for worker, count in taking:
                worker.offset += count
                if worker in appliers:
                    worker.model, worker.step = worker.model + (applied.uid,), step
                    worker.unacked[step] = record
            rank0 = members[0]
            if rank0 in appliers:
                if record.checkpoint:
                    rank0.uploads.append((round_id, step, json.dumps(rank0.model).encode()))
                rank0.reports.append((round_id, record))
            if last_torn:
                if data.draw(st.booleans()):  # rank 0's reporter got the step out before the death
                    self._send(rank0, len(rank0.reports), "in_order")
                # rank 0 half the time: a reporter that dies ahead of the others is the case
                # that makes a regroup void steps
                self._kill(data.draw(st.sampled_from(members + [rank0] * len(members))).id)
                for worker in members:
                    self._leave_round(worker)
                return
            self.tick()  # the master ticks while the round trains

    def _finish(self, members):
        """Rank 0 sends its pending checkpoints and reports, then the final model (loop._finish)."""
        rank0 = members[0]
        while rank0.uploads:
            self._upload(rank0)
        self._send(rank0, len(rank0.reports), "in_order")
        self.tick()
        if self.state.dispatcher.finished and self._call(self.state.upload_model, rank0.id, rank0.step, b"model"):
            self.finished_model = rank0.model

    @precondition(lambda self: any(w.reports or w.sent for w in self.workers.values()))
    @rule(k=st.integers(1, 4), how=st.sampled_from(["in_order", "duplicate", "reordered", "dropped"]), data=st.data())
    def deliver_reports(self, k, how, data):
        """Rank 0's reporter sends a batch (as in background.StepReporter); a refused batch is
        dropped. Any worker that ever was rank 0 may still send, dead or in a later round."""
        senders = sorted(w.id for w in self.workers.values() if w.reports or w.sent)
        if senders:
            self._send(self.workers[data.draw(st.sampled_from(senders))], k, how)

    def _send(self, sender, k, how):
        if how == "duplicate" and sender.sent:
            batch = sender.sent[-k:]
        else:
            batch, sender.reports = sender.reports[:k], sender.reports[k:]
            sender.sent += batch
            if how == "reordered":
                batch = batch[::-1]
            elif how == "dropped":
                return
        for round_id in sorted({r for r, _ in batch}):
            self._call(self.state.report_steps, sender.id, round_id, [rec for r, rec in batch if r == round_id])

    @precondition(lambda self: any(w.uploads for w in self.workers.values()))
    @rule(data=st.data())
    def upload_checkpoint(self, data):
        senders = sorted(w.id for w in self.workers.values() if w.uploads)
        if senders:
            self._upload(self.workers[data.draw(st.sampled_from(senders))])

    def _upload(self, sender):
        round_id, step, state = sender.uploads.pop(0)
        self._call(self.state.checkpoint_state, sender.id, round_id, step, state)

    @rule(worker_id=st.sampled_from(["w0.1", "w1.1", "w2.1", "w0.2", "intruder"]), step=st.integers(1, 12),
          task=st.integers(0, 12))
    def forged_calls(self, worker_id, step, task):
        """A worker that is dead or foreign claims rows, fails tasks and collectives, uploads a
        checkpoint; a live member that is not rank 0 reports a step."""
        self.tick()  # the master has seen the deaths (before that, a dead worker is live to it)
        forged = StepRecord(step=step, ranges=[RangeRecord(task_id=task, offset=0, count=1)], samples=1, loss=0.0, time=1.0)
        worker = self.workers.get(worker_id)
        if worker is not None and worker.alive:
            if self.state.ready_round and worker_id in self.state.ready_round.members[1:]:
                self._call(self.state.report_steps, worker_id, self.state.ready_round_id, [forged])
            return
        for round_id in {self.state.ready_round_id, max(self.state.ready_round_id - 1, 0)}:
            self._call(self.state.report_steps, worker_id, round_id, [forged])
            self._call(self.state.checkpoint_state, worker_id, round_id, step, b"[]")
            self._call(self.state.collective_failed, worker_id, round_id, "forged")
            self._call(self.state.task_failed, worker_id, task, "forged")

    @rule(data=st.data())
    def heartbeat(self, data):
        live = sorted(w.id for w in self._live() if w.registered)
        if live:
            worker = self.workers[data.draw(st.sampled_from(live))]
            worker.acked = self.state.heartbeat(worker.id, worker.step).acked_step

    @rule(now=st.integers(0, 2), data=st.data())
    def kill(self, now, data):
        live = sorted(w.id for w in self._live())
        if live and now == 2:  # drawn one time in three
            victim = self.workers[data.draw(st.sampled_from(live))]
            round_id = victim.round_id
            self._kill(victim.id)
            for worker in self._round_members(round_id) if round_id else []:
                self._leave_round(worker)

    @rule(now=st.integers(0, 9))
    def restart_master_from_newest_checkpoint(self, now):
        if now != 9:  # drawn one time in ten: a restart ends everything before it
            return
        for worker in self._live():
            worker.alive = False  # the master's workers leave with it
        self._start_master(self.committed[-1] if self.committed else None)

    # -- what must hold ------------------------------------------------------------------------
    def _counts(self, ranges):
        counts = {(e, s): np.zeros(rows, dtype=np.int64) for e in range(EPOCHS) for s, rows in SHARDS.items()}
        for epoch, shard, start, count in ranges:
            counts[(epoch, shard)][start:start + count] += 1
        return counts

    def _ledger_rows(self):
        rows = [(e["epoch"], e["shard"], e["start"], e["count"]) for e in read_audit(self.audit)]
        for consumed in self.ledger.tentative().values():
            for c in consumed:
                task = self.dispatcher.tasks[c.task_id]
                rows.append((task.epoch, list(SHARDS)[task.shard], task.start + c.offset, c.count))
        return rows

    def _model_rows(self, model):
        return [r for uid in model for r in self.applied[uid].rows]

    @invariant()
    def the_job_fails_only_when_it_must(self):
        # Honest workers never make the ledger refuse a report; and the job gives up on a step's
        # state only when no live worker holds it.
        assert "cannot be applied exactly once" not in self.state.failure, self.state.failure
        if "every worker that held" in self.state.failure:
            assert all(w.step < self.ledger.final_step for w in self._live()), self.state.failure

    @invariant()
    def no_row_applied_twice(self):
        for (epoch, shard), c in self._counts(self._ledger_rows()).items():
            assert c.max(initial=0) <= 1, f"ledger: a row of {shard} applied twice in epoch {epoch}"
        for worker in self._live():
            for (epoch, shard), c in self._counts(self._model_rows(worker.model)).items():
                assert c.max(initial=0) <= 1, f"{worker.id}'s model: a row of {shard} applied twice in epoch {epoch}"

    @invariant()
    def the_ledger_holds_only_rows_the_training_model_applied(self):
        # The ledger lags the model (reports travel), never leads it: a voided step's rows must
        # leave the ledger when the round goes on from a state without them.
        round_id = self._training_round()
        if round_id and not self.state.over:
            model = self._counts(self._model_rows(self._round_members(round_id)[0].model))
            for key, c in self._counts(self._ledger_rows()).items():
                assert (c <= model[key]).all(), f"the ledger holds rows of {key} the model of round {round_id} never applied"

    @invariant()
    def no_row_of_a_completed_epoch_lost(self):
        counts = self._counts(self._ledger_rows())
        for (epoch, shard), c in counts.items():
            if epoch < self.dispatcher.current_epoch:
                assert c.min(initial=1) == 1, f"a row of {shard} missing from completed epoch {epoch}"

    @invariant()
    def checkpoints_pair_a_model_with_its_own_ledger(self):
        for step, state, snapshot in self.committed:
            model_counts = self._counts(self._model_rows(json_model(state)))
            ledger_rows = [(e, shard, row, 1) for e in range(EPOCHS) if e < snapshot["current_epoch"]
                           for shard, rows in SHARDS.items() for row in range(rows)]
            for key, tasks in snapshot["epochs"].items():
                ledger_rows += [(int(key), list(SHARDS)[s], start, applied) for s, start, count, applied in tasks if applied]
            ledger_counts = self._counts(ledger_rows)
            for key in model_counts:
                assert (model_counts[key] == ledger_counts[key]).all(), f"checkpoint of step {step} pairs another model"

    @invariant()
    def a_finished_job_applied_every_row_exactly_once(self):
        if self.state.state == "succeeded":
            for (epoch, shard), c in self._counts([(e["epoch"], e["shard"], e["start"], e["count"]) for e in read_audit(self.audit)]).items():
                assert (c == 1).all(), f"audit of a finished job: epoch {epoch} {shard} not exact"
            for (epoch, shard), c in self._counts(self._model_rows(self.finished_model)).items():
                assert (c == 1).all(), f"final model: epoch {epoch} {shard} not exact"

    def teardown(self):
        # What the run reached, for --hypothesis-show-statistics: a run that never finishes a
        # job, commits a checkpoint or resumes checks less than it seems to.
        event(f"job {self.state.state}" + (f": {self.state.failure.split(':')[0]}" if self.state.failure else ""))
        event(f"checkpoints committed: {min(len(self.committed), 3)}{'+' if len(self.committed) > 3 else ''}")
        event(f"masters: {min(self.masters, 3)}")
        event(f"rounds settled: {min(self.state.ready_round_id, 5)}")
        self.ledger.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def json_model(data: bytes) -> tuple[int, ...]:
    return tuple(json.loads(data))


LedgerMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=80, deadline=None, suppress_health_check=list(HealthCheck),
)
test_ledger_under_random_interleavings = LedgerMachine.TestCase
