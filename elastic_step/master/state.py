"""The master's state machine. Every API call and every tick of the supervision loop goes
through one lock, so the dispatcher, the ledger and the membership always change together.

Its parts, each with one job, all behind that lock: the dispatcher (tasks) and the ledger
(applied rows), checkpoint pairing (pairing.py), throughput (throughput.py), the operator's
graceful stop (stopping.py); the membership,
the rounds and their settle are still here. Who may ask for what is checked first: only live
workers of this job change anything, and what only a round's member or its rank 0 may do is
refused to anyone else (Refused: the API's 403 and 409)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from elastic_step import defaults
from elastic_step.backends.api import Backend, WorkerExit
from elastic_step.errors import JobFailed
from elastic_step.master.dispatcher import Dispatcher
from elastic_step.master.events import EventLog, StepLog
from elastic_step.master.ledger import Consumed, Ledger, StepGap, StepRejected
from elastic_step.master.pairing import CheckpointPairing
from elastic_step.master.stopping import StopRequest, new_stop_request
from elastic_step.master.throughput import Throughput
from elastic_step.master.writes import MasterLock
from elastic_step.master.membership import Round, Slot, WorkerInfo, order_members, worker_id_for
from elastic_step.protocol import (
    HeartbeatReply,
    JobSpec,
    JobState,
    Rendezvous,
    RendezvousReply,
    ResourceSample,
    StepRecord,
    TaskInfo,
    TaskReply,
    TaskStatus,
    WorkerState,
)


class Refused(Exception):
    """A request the master will not act on. The API answers it with `status` and the message
    as a JSON error; the master's state is unchanged."""

    status = 409


class NotAMember(Refused):
    """The caller is not a live worker of this job, or not the member the request needs (a
    stale worker of an earlier attempt holds the same token: it may change nothing)."""

    status = 403


class Conflict(Refused):
    """The request is well-formed and from a member, but does not fit the job's state now."""

    status = 409


@dataclass
class InitialState:
    """Where the first round's state comes from when no worker holds one: a checkpoint
    (resume) or a model's parameters (warm start)."""

    kind: str  # "checkpoint" | "model"
    data: bytes
    step: int


@dataclass
class Timeouts:
    heartbeat_s: float = defaults.HEARTBEAT_TIMEOUT_S  # a worker silent this long is hung: dropped and killed
    rendezvous_s: float = defaults.RENDEZVOUS_TIMEOUT_S  # a proposed member that has not called in by then is dropped
    startup_grace_s: float = defaults.STARTUP_GRACE_S  # first round: wait this long for all MAX workers, then go with MIN


# A checkpoint's state may reach the master before the step's report (both are sent in the
# background); it may not run further ahead than this.
MAX_CHECKPOINT_LEAD = 10_000


class MasterState:
    def __init__(
        self,
        spec: JobSpec,
        dispatcher: Dispatcher,
        ledger: Ledger,
        backend: Backend,
        events: EventLog,
        min_workers: int,
        max_workers: int,
        max_relaunches: int = defaults.MAX_RELAUNCHES,
        timeouts: Timeouts | None = None,
        step_log: StepLog | None = None,
        initial_state: InitialState | None = None,
        on_checkpoint: Callable[[int, int, bytes, dict], None] | None = None,
    ):
        self.lock = MasterLock()  # disk writes queued under it run once it is released
        self.spec = spec
        self.dispatcher = dispatcher
        self.ledger = ledger
        self.ledger.defer_audit = True  # its audit lines are written off the lock, in order
        self.backend = backend
        self.events = events
        self.step_log = step_log
        self.initial_state = initial_state
        self.checkpoints = CheckpointPairing(on_checkpoint)
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.max_relaunches = max_relaunches
        self.timeouts = timeouts or Timeouts()
        self.target = max_workers
        self.slots = [Slot(i) for i in range(max_workers)]
        self.workers: dict[str, WorkerInfo] = {}
        self.round: Round | None = None  # the newest round, ready or still gathering
        self.ready_round: Round | None = None  # the newest round that became ready
        self._round_counter = 0
        self._regroup_cause: tuple[str, float] | None = None
        self._failed_since_settle: set[str] = set()
        self.started_at = time.time()
        self._last_tick = self.started_at
        self.state = JobState.RUNNING
        self.failure = ""
        self.final_model: bytes | None = None
        self.throughput = Throughput()
        self.stop_request: StopRequest | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def launch_all(self) -> None:
        with self.lock:
            for slot in self.slots:
                self._launch(slot)

    def _launch(self, slot: Slot) -> None:
        slot.attempts += 1
        worker_id = worker_id_for(slot.index, slot.attempts)
        slot.worker_id = worker_id
        self.workers[worker_id] = WorkerInfo(worker_id, slot.index, launched_at=time.time())
        self.backend.launch(slot.index, worker_id)
        self._event("launched", worker=worker_id, slot=slot.index, attempt=slot.attempts)

    def fail(self, reason: str) -> None:
        with self.lock:
            if self.state == JobState.RUNNING:
                self.state = JobState.FAILED
                self.failure = reason
                self._event("job_failed", reason)

    @property
    def over(self) -> bool:
        return self.state != JobState.RUNNING

    @property
    def ready_round_id(self) -> int:
        return self.ready_round.id if self.ready_round else 0

    # -- writes, off the lock ---------------------------------------------------------------------
    def _event(self, event: str, message: str = "", **fields) -> None:
        """An event: kept now, written (events.jsonl, the log, tracking) once the lock is released."""
        record = self.events.record(event, message, **fields)
        self.lock.writes.put(f"write event {event}", lambda: self.events.write(record))

    def _audit_written(self) -> None:
        """The ledger's newly final steps reach the audit file once the lock is released."""
        self.lock.writes.put("append to the audit file", self.ledger.write_audit)

    # -- who may ask ------------------------------------------------------------------------------
    def _live_worker(self, worker_id: str) -> WorkerInfo:
        """The caller as a live worker of this job (and heard from now), or refused."""
        worker = self.workers.get(worker_id)
        if worker is None or not worker.alive:
            raise NotAMember(
                f"{worker_id!r} is not a live worker of this job (it was never launched by this master, "
                "or it is an earlier attempt's worker that is gone); it must stop"
            )
        worker.last_seen = time.time()
        return worker

    def _member_of_ready_round(self, worker_id: str, round_id: int | None = None, rank0: bool = False) -> Round:
        """The newest ready round, if the caller is a member of it (its rank 0 where `rank0`)."""
        self._live_worker(worker_id)
        ready = self.ready_round
        if ready is None or worker_id not in ready.members:
            raise NotAMember(f"{worker_id} is not a member of the current round; rendezvous first")
        if round_id is not None and round_id != ready.id:
            raise Conflict(f"round {round_id} is over (the current round is {ready.id}); rendezvous again")
        if rank0 and ready.members[0] != worker_id:
            raise NotAMember(f"only rank 0 of round {ready.id} ({ready.members[0]}) may send this, not {worker_id}")
        return ready

    # -- worker calls ------------------------------------------------------------------------------
    def register(self, worker_id: str, pid: int, host: str) -> JobSpec | None:
        with self.lock:
            worker = self.workers.get(worker_id)
            if worker is None or not worker.alive:
                return None
            worker.state = WorkerState.LIVE if worker.state == WorkerState.LAUNCHED else worker.state
            worker.last_seen = time.time()
            worker.pid, worker.host = pid, host
            self._event("joined", worker=worker_id, pid=pid)
            return self.spec

    def _seen(self, worker_id: str) -> WorkerInfo | None:
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.last_seen = time.time()
        return worker

    def heartbeat(self, worker_id: str, step: int, resources: ResourceSample | None = None) -> HeartbeatReply:
        with self.lock:
            worker = self._seen(worker_id)
            stop = worker is None or not worker.alive or worker.state == WorkerState.RETIRING or self.over
            if worker is not None and step > worker.step:
                worker.step = step
            if worker is not None and worker.alive and resources is not None:
                if worker.resources is None or resources.time >= worker.resources.time:
                    worker.resources = resources  # the newest sample only
            return HeartbeatReply(
                round_id=self.round.id if self.round else 0,
                acked_step=self.ledger.final_step,
                action="stop" if stop else "continue",
            )

    def rendezvous(self, worker_id: str, step: int, unacked: list[StepRecord], left_round: int) -> RendezvousReply:
        """One non-blocking look; the API long-polls by calling again."""
        with self.lock:
            worker = self._seen(worker_id)
            if worker is None or not worker.alive or worker.state == WorkerState.RETIRING:
                return RendezvousReply(status=Rendezvous.STOP)
            if self.state == JobState.SUCCEEDED:
                return RendezvousReply(status=Rendezvous.DONE)
            if self.over:
                return RendezvousReply(status=Rendezvous.STOP)
            if not worker.ready:
                worker.ready = True
                self._event("ready", worker=worker_id)
            current = self.round
            if current is not None and current.ready and current.id <= left_round:
                # The worker left the current round (its collective failed or it saw a regroup
                # flag): that round is over for everyone.
                self.request_regroup(f"{worker_id} left round {current.id}")
                current = None
            if current is None or worker_id not in current.members:
                worker.step, worker.unacked = step, unacked
                return RendezvousReply(status=Rendezvous.WAIT)
            if worker.joined_round != current.id:
                worker.joined_round = current.id
                worker.step, worker.unacked = step, unacked
            if not current.ready and all(self.workers[m].joined_round == current.id for m in current.members):
                self._settle(current)
            if not current.ready:
                return RendezvousReply(status=Rendezvous.WAIT)
            return RendezvousReply(
                status=Rendezvous.READY,
                round_id=current.id,
                rank=current.members.index(worker_id),
                world_size=len(current.members),
                store_prefix=current.store_prefix,
                source_rank=current.source_rank,
                start_step=current.start_step,
                acked_step=self.ledger.final_step,
                initial_state=current.initial_state,
            )

    def next_task(self, worker_id: str, round_id: int) -> TaskReply:
        with self.lock:
            self._seen(worker_id)
            current = self.round
            if current is None or not current.ready or current.id != round_id or worker_id not in current.members:
                return TaskReply(status=TaskStatus.REGROUP)
            if self.dispatcher.finished:
                return TaskReply(status=TaskStatus.DONE)
            task = self.dispatcher.next_task(worker_id)
            if task is None:
                return TaskReply(status=TaskStatus.DONE if self.dispatcher.finished else TaskStatus.WAIT)
            return TaskReply(
                status=TaskStatus.TASK,
                task=TaskInfo(id=task.id, epoch=task.epoch, shard=task.shard, start=task.start, count=task.count),
            )

    def task_failed(self, worker_id: str, task_id: int, error: str) -> None:
        with self.lock:
            self._live_worker(worker_id)
            task = self.dispatcher.tasks.get(task_id)
            if task is None or self.dispatcher.holder.get(task_id) != worker_id:
                return  # it was taken back at a regroup while the worker read it: nothing to charge
            self._event("task_failed", f"{task.describe(self.dispatcher.shard_names)}: {error}", worker=worker_id)
            try:
                self.dispatcher.return_task(task_id, failed=True, reason=error)
            except JobFailed as exc:
                self.fail(str(exc))

    def report_steps(self, worker_id: str, round_id: int, steps: list[StepRecord]) -> int:
        """Rank 0's report of applied steps. A report of an older round is acknowledged and
        ignored: after a settle, that round's steps are in the ledger (from the state source) or
        voided. A lost earlier report (a gap) makes the master regroup, and the new round's
        state source re-reports every step the master lacks (each rank keeps its unacknowledged
        steps' ranges). A step the ledger cannot take fails the job: every rank holds the same
        ranges, so neither a resend nor a regroup could correct them."""
        with self.lock:
            self._live_worker(worker_id)
            if round_id != self.ready_round_id:
                return self.ledger.final_step
            ready = self._member_of_ready_round(worker_id, round_id, rank0=True)
            for record in steps:
                try:
                    self._ingest(record, ready.members)
                except StepGap as exc:
                    self.request_regroup(f"step reports from {worker_id} were lost ({exc})")
                    raise Conflict(f"{exc}; the master regroups and takes the missing steps from the state source") from None
                except StepRejected as exc:
                    self._fail_inexact(worker_id, round_id, exc)
                    raise Conflict(str(exc)) from None
            return self.ledger.final_step

    def _fail_inexact(self, reporter: str, round_id: int, exc: Exception) -> None:
        self.fail(
            f"the step report from {reporter} (round {round_id}) cannot be applied exactly once: {exc}. "
            "The ledger would no longer be exact, so the job stops here; rerun it with --resume to "
            "continue from its newest checkpoint"
        )

    def _ingest(self, record: StepRecord, members: list[str]) -> None:
        """Take one applied step. `members` is the round it was applied in (position = rank):
        each rank's range must be of a task the master handed to that member."""
        if len(record.ranges) != len(members):
            raise StepRejected(
                f"step {record.step} has ranges for {len(record.ranges)} ranks; its round has {len(members)} members"
            )
        held = [(Consumed(r.task_id, r.offset, r.count), member) for member, r in zip(members, record.ranges) if r is not None]
        if not self.ledger.ingest(record.step, [c for c, _ in held], [m for _, m in held]):
            return
        for consumed, member in held:
            self.workers[member].rows_applied += consumed.count
        self.throughput.add(record.time, record.samples, record.loss)
        current = self.round
        self._audit_written()
        if self.step_log is not None:
            step_log, round_id = self.step_log, self.ready_round_id
            self.lock.writes.put(f"log step {record.step}", lambda: step_log.add(record, world_size=len(record.ranges), round_id=round_id))
        if record.checkpoint and self.checkpoints.enabled:
            # The ledger as of exactly this step: the other half of the checkpoint.
            self.checkpoints.ledger_at(record.step, self.dispatcher.snapshot(), self.dispatcher.current_epoch, self.ready_round_id)
            if self.stop_request is not None:
                self.stop_request.flagged(record.step)
        if current is not None and current.ready and current.first_step_at is None and record.step > current.start_step:
            current.first_step_at = record.time
            if current.cause_time:
                self._event(
                    "recovered",
                    round=current.id,
                    seconds=round(record.time - current.cause_time, 4),
                    step_time=record.time,
                    cause=current.cause,
                )

    def checkpoint_state(self, worker_id: str, round_id: int, step: int, data: bytes) -> None:
        """Rank 0's model state after `step`, the half of a checkpoint the ledger cannot give.
        Only the current round's rank 0 may send it, for a step after the round's start: a late
        upload from an earlier round (a partitioned old rank 0, or one whose steps a regroup
        voided) would pair stale state with the new ledger."""
        with self.lock:
            ready = self._member_of_ready_round(worker_id, round_id, rank0=True)
            if step <= ready.start_step or step > self.ledger.applied_step + MAX_CHECKPOINT_LEAD:
                raise Conflict(
                    f"step {step} is not a step of round {ready.id} (it started at step {ready.start_step}, "
                    f"the master has step {self.ledger.applied_step})"
                )
            self.checkpoints.state_at(step, data, ready.id)

    def collective_failed(self, worker_id: str, round_id: int, error: str) -> None:
        with self.lock:
            self._live_worker(worker_id)
            if self.round is not None and self.round.ready and self.round.id == round_id:
                if worker_id not in self.round.members:
                    raise NotAMember(f"{worker_id} is not a member of round {round_id}")
                self._event("collective_failed", error[:300], worker=worker_id, round=round_id)
                self.request_regroup(f"collective failed on {worker_id}")

    def fail_by_worker(self, worker_id: str, reason: str) -> None:
        """A member found the job cannot go on (a non-finite loss): fail it with its reason."""
        with self.lock:
            self._member_of_ready_round(worker_id)
            self.fail(f"{worker_id}: {reason}")

    def upload_model(self, worker_id: str, step: int, data: bytes) -> bool:
        with self.lock:
            self._member_of_ready_round(worker_id, rank0=True)
            if not self.dispatcher.finished or step != self.ledger.applied_step:
                return False
            self.ledger.finalize_through(step)
            self._audit_written()
            self.final_model = data
            if self.state == JobState.RUNNING:
                self.state = JobState.SUCCEEDED
                self._event("job_succeeded", worker=worker_id, step=step)
            return True

    # -- scaling ----------------------------------------------------------------------------------
    def scale(self, target: int) -> None:
        with self.lock:
            if self.over:
                raise ValueError(f"the job has ended ({self.state}); there is nothing to scale")
            if not self.min_workers <= target <= self.max_workers:
                raise ValueError(
                    f"--workers {target} is outside this job's range {self.min_workers}:{self.max_workers}"
                )
            self.target = target
            self._event("scaled", target=target)
            for slot in self.slots:
                want = slot.index < target
                if want and not slot.active:
                    slot.active = True
                    slot.counted_relaunches = 0
                    self._launch(slot)
                elif not want and slot.active:
                    slot.active = False
                    worker = self.workers.get(slot.worker_id or "")
                    if worker is not None and worker.alive:
                        worker.state = WorkerState.RETIRING
                        self.request_regroup(f"scaled in: {worker.id} retires")

    # -- stopping ---------------------------------------------------------------------------------
    def request_stop(self) -> dict:
        """The operator's graceful stop: rank 0 checkpoints its next step, and once that
        checkpoint is handed over the job is STOPPED (its workers are told to stop). Asking again
        changes nothing."""
        with self.lock:
            if self.over:
                raise ValueError(f"the job has ended ({self.state}); there is nothing to stop")
            if not self.checkpoints.enabled:
                raise ValueError(
                    "this job takes no checkpoints (--checkpoint-steps 0), so a stop would lose its progress; "
                    "let it finish, or end it with SIGTERM to its master"
                )
            if self.stop_request is None:
                now = time.time()
                self.stop_request = new_stop_request(now, self.ledger.applied_step)
                self._event("stop_requested", step=self.ledger.applied_step)
            return self.status()

    @property
    def checkpoint_now(self) -> bool:
        """Rank 0 should checkpoint its next step: a stop waits for it."""
        return self.stop_request is not None and self.stop_request.checkpoint_now and not self.over

    def _maybe_stop(self, handed: list[tuple[int, int]], now: float) -> None:
        if self.stop_request is None or self.over:
            return
        outcome = self.stop_request.outcome(handed, now)
        if outcome is not None:
            step, problem = outcome
            self.state, self.failure = JobState.STOPPED, problem
            self._event("stopped", problem or f"stopped after the checkpoint of step {step}", step=step)

    # -- supervision ------------------------------------------------------------------------------
    def request_regroup(self, cause: str) -> None:
        if self._regroup_cause is None:
            self._regroup_cause = (cause, time.time())

    def on_exit(self, exit_: WorkerExit) -> None:
        worker = self.workers.get(exit_.worker_id)
        if worker is None:
            return
        was_member = self.round is not None and worker.id in self.round.members
        retiring = worker.state == WorkerState.RETIRING
        worker.exit_reason = exit_.reason
        worker.exited_at = worker.exited_at or time.time()
        if worker.state != WorkerState.GONE:
            worker.state = WorkerState.GONE
            if not self.over and not retiring and exit_.relaunch != "free":  # the cluster took it: not the data's fault
                self._failed_since_settle.add(worker.id)
        if self.over:
            return
        if retiring:
            self._event("left", worker=worker.id, reason=exit_.reason)
        else:
            self._event("died", worker=worker.id, reason=exit_.reason, returncode=exit_.returncode)
        if was_member:
            self.request_regroup(f"{worker.id} {exit_.reason}")
        slot = self.slots[worker.slot]
        if retiring or not slot.active or slot.worker_id != worker.id:
            return
        if exit_.relaunch == "never":
            self._event("not_relaunched", f"{worker.id} {exit_.reason}", worker=worker.id)
        elif exit_.relaunch == "free" or slot.counted_relaunches < self.max_relaunches:
            slot.counted_relaunches += exit_.relaunch == "count"
            self._event("relaunched", worker=worker.id, slot=slot.index)
            self._launch(slot)
        else:
            self._event("slot_exhausted", f"slot {slot.index} used its {self.max_relaunches} relaunches")

    def _drop(self, worker: WorkerInfo, reason: str) -> None:
        """A worker that is alive but useless (hung, or missing at rendezvous): kill it; its exit
        then counts as a death."""
        self._event("dropped", reason, worker=worker.id)
        self.backend.stop(worker.id)

    def _forgive_silence_while_paused(self, now: float) -> None:
        """The master ticks every 50 ms. A gap of half the heartbeat timeout means the master
        itself was not running (its machine paused or snapshotted, the process stopped): the
        workers' silence over that gap is not theirs, so nobody is dropped for it, neither as hung
        nor as missing at a pending rendezvous. (Seen on a VM snapshot: a 155 s pause, after which
        every worker looked hung and the job failed.)"""
        gap, self._last_tick = now - self._last_tick, now
        if gap > self.timeouts.heartbeat_s / 2:
            self._event("master_paused", seconds=round(gap, 3))
            # Every silence clock restarts; a truly hung or absent worker is dropped a timeout later.
            for worker in self.workers.values():
                worker.last_seen = now
            if self.round is not None and not self.round.ready:
                self.round.proposed_at = now

    def tick(self) -> None:
        with self.lock:
            if self.lock.writes.error:
                self.fail(self.lock.writes.error)
            for exit_ in self.backend.poll():
                self.on_exit(exit_)
            if self.over:
                return
            handed = self.checkpoints.hand_over(self.ledger.final_step) if self.checkpoints else []
            for pair in handed:
                # Written in order after the audit lines of the steps it covers (queued earlier).
                self.lock.writes.put(f"write the checkpoint of step {pair.step}",
                                     lambda pair=pair: self.checkpoints.on_checkpoint(pair.step, pair.epoch, pair.state, pair.ledger))
                self._event("checkpoint", step=pair.step, epoch=pair.epoch)
            now = time.time()
            self._maybe_stop([(pair.step, pair.epoch) for pair in handed], now)
            if self.over:
                return
            self._forgive_silence_while_paused(now)
            for worker in self.workers.values():
                if worker.state in (WorkerState.LIVE, WorkerState.RETIRING) and now - worker.last_seen > self.timeouts.heartbeat_s:
                    worker.last_seen = now  # drop once, not every tick until it is reaped
                    self._drop(worker, f"{worker.id} sent no heartbeat for {self.timeouts.heartbeat_s:.0f}s (hung)")
            current = self.round
            if current is not None and not current.ready and now - current.proposed_at > self.timeouts.rendezvous_s:
                for member in current.members:
                    worker = self.workers[member]
                    if worker.joined_round != current.id and worker.alive:
                        worker.joined_round = -1
                        self._drop(worker, f"{member} did not join round {current.id} within {self.timeouts.rendezvous_s:.0f}s")
            self._maybe_propose(now)
            self._check_enough_workers()

    def _check_enough_workers(self) -> None:
        alive = [w for w in self.workers.values() if w.alive and w.state != WorkerState.RETIRING]
        if len(alive) < self.min_workers:
            reasons = "; ".join(f"{w.id} {w.exit_reason}" for w in self.workers.values() if w.exit_reason)
            self.fail(
                f"only {len(alive)} workers left and fewer than --workers minimum {self.min_workers}, "
                f"no relaunches left (--max-relaunches {self.max_relaunches}): {reasons}"
            )

    def _maybe_propose(self, now: float) -> None:
        live = [w for w in self.workers.values() if w.state == WorkerState.LIVE]
        current = self.round
        if current is not None:
            # Once training runs, a worker takes part only when it is ready to train. A joiner
            # that has registered but still imports its framework (TensorFlow: seconds) would
            # otherwise hold every survivor at the rendezvous until it is done. The first round
            # has no survivors to hold up, so it takes every registered worker, as do rounds
            # re-formed from members that never became ready (a first round that lost one).
            live = [w for w in live if w.ready or w.id in current.members]
        cause = self._regroup_cause
        if cause is None:
            if current is None:
                startup_over = now - self.started_at > self.timeouts.startup_grace_s
                if len(live) >= self.target or (startup_over and len(live) >= self.min_workers):
                    cause = ("first round", 0.0)
            else:
                gone = [m for m in current.members if self.workers[m].state != WorkerState.LIVE]
                joiners = [w for w in live if w.id not in current.members]
                if gone:
                    cause = (f"{', '.join(gone)} gone", now)
                elif joiners and len(current.members) < self.target:
                    cause = (f"{', '.join(w.id for w in joiners)} joined", 0.0)
        if cause is None or len(live) < self.min_workers:
            return
        members = order_members(current.members if current else [], live, self.target)
        self._round_counter += 1
        self.round = Round(self._round_counter, members, proposed_at=now, cause=cause[0], cause_time=cause[1])
        self._regroup_cause = None
        self._event("round_proposed", round=self.round.id, members=members, cause=cause[0])

    def _settle(self, current: Round) -> None:
        """Every member has called in: pick the state source, settle the ledger, go."""
        steps = [self.workers[m].step for m in current.members]
        newest = max(steps)
        initial = ""
        if newest < 0 and self.initial_state is not None and self.initial_state.step >= self.ledger.final_step:
            # Nobody holds state yet: rank 0 loads the checkpoint (resume) or model (warm start).
            initial, newest, steps[0] = self.initial_state.kind, self.initial_state.step, self.initial_state.step
        if self.ledger.final_step > 0 and newest < self.ledger.final_step:
            self.fail(
                f"every worker that held the model state of step {self.ledger.final_step} is gone "
                f"(newest survivor is at step {max(newest, 0)}); rerun the job with --resume to continue "
                "from its newest checkpoint"
            )
            return
        source_rank = steps.index(newest)
        start_step = max(newest, 0)
        # The source's unacknowledged steps were applied in the round it last trained in, the
        # newest ready one (a worker that missed a ready round holds no newer step than it).
        previous = self.ready_round.members if self.ready_round else []
        for record in sorted(self.workers[current.members[source_rank]].unacked, key=lambda r: r.step):
            if self.ledger.applied_step < record.step <= start_step:
                try:
                    self._ingest(record, previous)
                except (StepGap, StepRejected) as exc:
                    self._fail_inexact(current.members[source_rank], current.id, exc)
                    return
        if self.ledger.applied_step < start_step:
            # The source applied steps the master never received and it no longer holds: their
            # rows would go back to todo and be applied to the model a second time.
            self._fail_inexact(current.members[source_rank], current.id, StepGap(
                f"the state source is at step {start_step} but holds no record of steps "
                f"{self.ledger.applied_step + 1}..{start_step}"))
            return
        voided_rows = self.ledger.void_after(start_step)
        self.checkpoints.void_after(start_step)
        # start_step stays tentative here: until the source has broadcast it, only the source
        # holds it. If the source dies first, the next settle must void it and go on from the
        # survivors' step. It becomes final with the round's first reported step (every rank
        # applied start_step to enter that step's collective).
        try:
            returned = self.dispatcher.return_all(self._failed_since_settle)
        except JobFailed as exc:
            self.fail(str(exc))
            return
        self._failed_since_settle = set()
        current.ready, current.ready_at = True, time.time()
        current.source_rank, current.start_step, current.initial_state = source_rank, start_step, initial
        self.ready_round = current
        for member in current.members:
            self.workers[member].unacked = []
        self._event(
            "regrouped",
            round=current.id,
            world_size=len(current.members),
            members=current.members,
            start_step=start_step,
            source=current.members[source_rank],
            tasks_returned=returned,
            rows_voided=voided_rows,
        )

    # -- status -------------------------------------------------------------------------------------
    def status(self) -> dict:
        with self.lock:
            done, total = self.dispatcher.epoch_progress()
            current = self.round
            return {
                "job": self.spec.job_name,
                "state": self.state,
                "started_at": self.started_at,
                "stopping": self.stop_request is not None and not self.over,
                "failure": self.failure,
                "round": current.id if current else 0,
                "round_ready": bool(current and current.ready),
                "world_size": len(current.members) if current and current.ready else 0,
                "target_workers": self.target,
                "workers_range": [self.min_workers, self.max_workers],
                "epoch": min(self.dispatcher.current_epoch, self.dispatcher.epochs - 1),
                "epochs": self.dispatcher.epochs,
                "rows_done": done,
                "rows_total": total,
                "step": self.ledger.applied_step,
                "loss": self.throughput.loss,
                "samples_per_s": round(self.throughput.samples_per_second(), 1),
                "workers": [
                    {
                        "id": w.id,
                        "slot": w.slot,
                        "state": w.state,
                        "rank": current.members.index(w.id) if current and w.id in current.members else None,
                        "step": w.step,
                        "rows_applied": w.rows_applied,
                        "exit": w.exit_reason,
                        "host": w.host,
                        "launched_at": w.launched_at,
                        "last_seen": w.last_seen or None,
                        "exited_at": w.exited_at,
                        "resources": w.resources.model_dump() if w.resources is not None else None,
                        **self.backend.describe(w.id),
                        **({"pid": w.pid} if w.pid and "pid" not in self.backend.describe(w.id) else {}),
                    }
                    for w in self.workers.values()
                    if w.alive or w.exit_reason
                ],
            }
