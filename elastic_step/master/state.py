"""The master's state: one façade over parts with one job each, all behind one lock, so the
dispatcher, the ledger, the checkpoint pairing and the membership always change together.

- membership.py: slots and workers (launch, register, heartbeat, exits and relaunches, drops,
  the silence clocks, scaling, whether enough workers are left);
- rounds.py: round proposal, rendezvous and settle, regroup causes;
- dispatcher.py and ledger.py: tasks and applied rows; pairing.py: checkpoint halves;
- throughput.py: samples/s for /status; stopping.py: the operator's graceful stop;
- status.py: /status as a function of these parts; writes.py: the lock, and the disk writes
  that wait until it is released.

Every public method here is one API call or the supervision loop's tick: it takes the lock, says
who may ask (only live workers of this job change anything; what only a round's member or its
rank 0 may do is refused to anyone else: Refused, the API's 403 and 409), and hands the work to
the part whose job it is. Nothing slow runs under the lock: events, step metrics, audit lines and
handed-over checkpoints are queued and written, in order, once it is released."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from elastic_step import defaults
from elastic_step.backends.api import Backend, WorkerExit
from elastic_step.errors import JobFailed
from elastic_step.master.dispatcher import Dispatcher
from elastic_step.master.events import EventLog, StepLog
from elastic_step.master.ledger import Consumed, Ledger, StepGap, StepRejected
from elastic_step.master.membership import Membership, Round, WorkerInfo
from elastic_step.master.pairing import CheckpointPairing
from elastic_step.master.refusals import Conflict, NotAMember, Refused
from elastic_step.master.restore import InitialState, RestorePoint
from elastic_step.master.rounds import Rounds, inexact
from elastic_step.master.status import job_status
from elastic_step.master.stopping import StopCause, StopRequest, new_stop_request
from elastic_step.master.throughput import Throughput
from elastic_step.master.writes import MasterLock
from elastic_step.protocol import (
    EngineVersion,
    EventKind,
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
    this_engine,
)

__all__ = ["Conflict", "InitialState", "MasterState", "NotAMember", "Refused", "Timeouts"]


@dataclass
class Timeouts:
    heartbeat_s: float = defaults.HEARTBEAT_TIMEOUT_S  # a worker silent this long is hung: dropped and killed
    rendezvous_s: float = defaults.RENDEZVOUS_TIMEOUT_S  # a proposed member that has not called in by then is dropped
    startup_grace_s: float = defaults.STARTUP_GRACE_S  # first round: wait this long for all MAX workers, then go with MIN
    warm_up_s: float = defaults.WARM_UP_SILENCE_S  # the silence allowed a worker not yet called in to a round


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
        spares: int = 0,
        ps_shards=None,
        restore_point: RestorePoint | None = None,
    ):
        self.lock = MasterLock()  # disk writes queued under it run once it is released
        self._wake = threading.Event()  # cuts the supervising loop's pause short (wait_for_work)
        self.spec = spec
        self.dispatcher = dispatcher
        self.ledger = ledger
        self.ledger.defer_audit = True  # its audit lines are written off the lock, in order
        self.backend = backend
        self.events = events
        self.step_log = step_log
        # The cause time of the newest loss a recovered event was given for: a round that inherited
        # a loss (rounds.pending_recovery) whose older round's first step turns up later gives none.
        self.recovered_from = 0.0
        self.ps_shards = ps_shards  # a --mode ps job's ShardMonitor (master/ps_monitor.py): its rows in /status
        self.checkpoints = CheckpointPairing(on_checkpoint)
        self.timeouts = timeouts or Timeouts()
        self.membership = Membership(backend, min_workers, max_workers, max_relaunches, self.timeouts,
                                     event=self._event, regroup=self.request_regroup, spares=spares)
        self.rounds = Rounds(self.membership, dispatcher, ledger, self.checkpoints, initial_state,
                             event=self._event, ingest=self._ingest, fail=self.fail, restore_point=restore_point)
        self.started_at = time.time()
        self.state = JobState.RUNNING
        self.failure = ""
        self.final_model: bytes | None = None
        self.throughput = Throughput()
        self.stop_request: StopRequest | None = None

    # -- what the parts hold, as the API and the tests read it -----------------------------------
    @property
    def workers(self) -> dict[str, WorkerInfo]:
        return self.membership.workers

    @property
    def target(self) -> int:
        return self.membership.target

    @property
    def min_workers(self) -> int:
        return self.membership.min_workers

    @property
    def max_workers(self) -> int:
        return self.membership.max_workers

    @property
    def round(self) -> Round | None:
        return self.rounds.round

    @property
    def ready_round(self) -> Round | None:
        return self.rounds.ready_round

    @property
    def ready_round_id(self) -> int:
        return self.rounds.ready_round_id

    @property
    def initial_state(self) -> InitialState | None:
        return self.rounds.initial_state

    @property
    def over(self) -> bool:
        return self.state != JobState.RUNNING

    def last_members(self) -> list[str]:
        """The workers of the last round: the only ones that may still be leaving with something
        of the job's when it ends (a joiner still starting or a spare holds nothing)."""
        with self.lock:
            return list(self.rounds.round.members) if self.rounds.round is not None else []

    # -- lifecycle ------------------------------------------------------------------------------
    def launch_all(self) -> None:
        with self.lock:
            self.membership.launch_all()

    def fail(self, reason: str) -> None:
        with self.lock:
            if self.state == JobState.RUNNING and self.stop_request is not None and self.stop_request.cause is StopCause.PREEMPTION:
                # After a SIGTERM to the master, what else ends the job is the preemption's doing (a
                # node drain takes its workers too): it ends preempted, from its newest checkpoint.
                self.state, self.failure = JobState.PREEMPTED, f"no checkpoint after the SIGTERM: {reason}"
                self._event(EventKind.PREEMPTED, self.failure, step=self.ledger.applied_step)
            if self.state == JobState.RUNNING:
                self.state = JobState.FAILED
                self.failure = reason
                self._event(EventKind.JOB_FAILED, reason)

    # -- writes, off the lock ---------------------------------------------------------------------
    def _event(self, event: EventKind, message: str = "", **fields) -> None:
        """An event: kept now, written (events.jsonl, the log, tracking) once the lock is released."""
        record = self.events.record(event, message, **fields)
        self.lock.writes.put(f"write event {event}", lambda: self.events.write(record))

    def _audit_written(self) -> None:
        """The ledger's newly final steps reach the audit file once the lock is released."""
        self.lock.writes.put("append to the audit file", self.ledger.write_audit)

    # -- worker calls ------------------------------------------------------------------------------
    def register(self, worker_id: str, pid: int, host: str, engine: EngineVersion | None = None) -> JobSpec:
        """A launched worker's one registration. A live worker registers once (a relaunch gets a
        new id): registering its id again could only be someone else holding the token, and a
        fake engine there would fail the job, so it is refused; the same registration repeated
        (a retry whose reply was lost) changes nothing and is answered again."""
        with self.lock:
            known = self.membership.workers.get(worker_id)
            if known is not None and known.alive and known.state != WorkerState.LAUNCHED:
                if (known.pid, known.host) == (pid, host) and engine_mismatch(worker_id, engine) is None:
                    return self.spec
                raise Conflict(f"worker {worker_id!r} has registered already (pid {known.pid} on {known.host!r}); "
                               "a worker registers once, and a relaunch gets an id of its own")
            if not self.membership.register(worker_id, pid, host):
                raise Conflict(f"worker {worker_id!r} was not launched by this master or is gone")
            mismatch = engine_mismatch(worker_id, engine)
            if mismatch:
                # Every slot runs the same image: a relaunch would meet the same engine.
                if not self.over:
                    self.fail(mismatch)
                raise Conflict(mismatch)
            return self.spec

    def heartbeat(self, worker_id: str, step: int, resources: ResourceSample | None = None, round_id: int = 0) -> HeartbeatReply:
        with self.lock:
            stop = self.membership.heartbeat(worker_id, step, resources, self.over)
            self._held(worker_id, round_id, step)
            return HeartbeatReply(
                round_id=self.round.id if self.round else 0,
                acked_step=self.ledger.final_step,
                action="stop" if stop else "continue",
            )

    def _held(self, worker_id: str, round_id: int, step: int) -> None:
        """A member of the ready round applied `step` in it. Once every member has applied a step,
        no regroup can void it (the next round's source holds at least it): it is final now,
        and its rows reach the audit, rather than when rank 0 reports the step after it. Only a
        step after the round's start counts: before its first collective a member may not hold
        the start step yet (the source has not shared it)."""
        ready = self.rounds.ready_round
        if ready is None or ready.id != round_id or worker_id not in ready.members or step <= ready.start_step:
            return
        ready.held[worker_id] = max(step, ready.held.get(worker_id, step))
        self._finalize_held(ready)

    def _finalize_held(self, ready: Round) -> None:
        """Finalize through the lowest step every member of `ready` holds and rank 0 has reported
        (whichever of the beats and the report comes last)."""
        if len(ready.held) < len(ready.members):
            return
        through = min(min(ready.held.values()), self.ledger.applied_step)
        if through > self.ledger.final_step:
            self.ledger.finalize_through(through)
            self._audit_written()

    def rendezvous(self, worker_id: str, step: int, unacked: list[StepRecord], left_round: int) -> RendezvousReply:
        """One non-blocking look; the API long-polls by calling again."""
        with self.lock:
            worker = self.membership.seen(worker_id)
            if worker is None or not worker.alive or worker.state == WorkerState.RETIRING:
                return RendezvousReply(status=Rendezvous.STOP)
            if self.state == JobState.SUCCEEDED:
                return RendezvousReply(status=Rendezvous.DONE)
            if self.over:
                return RendezvousReply(status=Rendezvous.STOP)
            if not worker.ready:
                worker.ready = True
                self._event(EventKind.READY, worker=worker_id)
            return self.rounds.rendezvous(worker, step, unacked, left_round)

    def next_task(self, worker_id: str, round_id: int) -> TaskReply:
        with self.lock:
            self.membership.seen(worker_id)
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
            self.membership.live_worker(worker_id)
            task = self.dispatcher.tasks.get(task_id)
            if task is None or self.dispatcher.holder.get(task_id) != worker_id:
                return  # it was taken back at a regroup while the worker read it: nothing to charge
            self._event(EventKind.TASK_FAILED, f"{task.describe(self.dispatcher.shard_names)}: {error}", worker=worker_id)
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
            self.membership.live_worker(worker_id)
            if round_id != self.ready_round_id:
                return self.ledger.final_step
            ready = self.rounds.member_of_ready_round(worker_id, round_id, rank0=True)
            for record in steps:
                try:
                    self._ingest(record, ready)
                except StepGap as exc:
                    self.request_regroup(f"step reports from {worker_id} were lost ({exc})")
                    raise Conflict(f"{exc}; the master regroups and takes the missing steps from the state source") from None
                except StepRejected as exc:
                    self.fail(inexact(worker_id, round_id, exc))
                    raise Conflict(str(exc)) from None
            self._finalize_held(ready)  # the members' beats may have come first
            return self.ledger.final_step

    def _ingest(self, record: StepRecord, applied_in: Round | None) -> None:
        """Take one applied step of the round it was applied in, whose members (position = rank)
        must each have been handed the task of its range. That round may no longer be the newest:
        a smaller group's first step can reach the master only as the state source's unacknowledged
        step when the joiner's round settles, and it is still that group's recovery."""
        members = applied_in.members if applied_in is not None else []
        if len(record.ranges) != len(members):
            raise StepRejected(
                f"step {record.step} has ranges for {len(record.ranges)} ranks; its round has {len(members)} members"
            )
        held = [(Consumed(r.task_id, r.offset, r.count), member)
                for member, entry in zip(members, record.ranges) if entry is not None
                for r in (entry if isinstance(entry, list) else [entry])]
        if not self.ledger.ingest(record.step, [c for c, _ in held], [m for _, m in held]):
            return
        self.throughput.add(record.time, record.samples, record.loss)
        self._audit_written()
        if self.step_log is not None:
            step_log, round_id = self.step_log, self.ready_round_id
            self.lock.writes.put(f"log step {record.step}", lambda: step_log.add(record, world_size=len(record.ranges), round_id=round_id))
        if record.checkpoint and self.checkpoints.enabled:
            # The ledger as of exactly this step: the other half of the checkpoint.
            self.checkpoints.ledger_at(record.step, self.dispatcher.snapshot(), self.dispatcher.current_epoch, self.ready_round_id,
                                       rows_final=self.ledger.rows_through(record.step),
                                       worker_rows=self.ledger.worker_rows(record.step))
            if self.stop_request is not None:
                self.stop_request.flagged(record.step)
        if applied_in is not None and applied_in.first_step_at is None and record.step > applied_in.start_step:
            applied_in.first_step_at = record.time
            if applied_in.cause_time > self.recovered_from:
                self.recovered_from = applied_in.cause_time
                self._event(
                    EventKind.RECOVERED,
                    round=applied_in.id,
                    seconds=round(record.time - applied_in.cause_time, 4),
                    step_time=record.time,
                    cause=applied_in.cause,
                )

    def checkpoint_state(self, worker_id: str, round_id: int, step: int, data: bytes) -> None:
        """Rank 0's model state after `step`, the half of a checkpoint the ledger cannot give.
        Only the current round's rank 0 may send it, for a step after the round's start: a late
        upload from an earlier round (a partitioned old rank 0, or one whose steps a regroup
        voided) would pair stale state with the new ledger."""
        with self.lock:
            ready = self.rounds.member_of_ready_round(worker_id, round_id, rank0=True)
            if step <= ready.start_step or step > self.ledger.applied_step + MAX_CHECKPOINT_LEAD:
                raise Conflict(
                    f"step {step} is not a step of round {ready.id} (it started at step {ready.start_step}, "
                    f"the master has step {self.ledger.applied_step})"
                )
            self.checkpoints.state_at(step, data, ready.id)

    def collective_failed(self, worker_id: str, round_id: int, error: str) -> None:
        with self.lock:
            self.membership.live_worker(worker_id)
            self.rounds.collective_failed(worker_id, round_id, error)
        self._wake.set()  # the regroup is proposed at the next tick: now, not up to a pause later

    def wait_for_work(self, timeout_s: float) -> None:
        """The supervising loop's pause between ticks, ended early when a member reports that its
        round's collective failed: the ticks propose the regroup that recovery waits for."""
        self._wake.wait(timeout_s)
        self._wake.clear()

    def fail_by_worker(self, worker_id: str, reason: str) -> None:
        """A member found the job cannot go on (a non-finite loss): fail it with its reason."""
        with self.lock:
            self.rounds.member_of_ready_round(worker_id)
            self.fail(f"{worker_id}: {reason}")

    def preflight_failed(self, worker_id: str, reason: str) -> None:
        """A live worker of this job (launched by it, not yet in a round) cannot do what every
        worker must: the job fails now with its reason, rather than after a relaunch of every slot
        (each of which would fail the same way)."""
        with self.lock:
            worker = self.membership.live_worker(worker_id)
            if worker.ready:  # it has called in to a round, so its pre-flight check had passed
                raise Conflict(f"worker {worker_id} has joined a round, so it passed its pre-flight check; "
                               "report a failure of a running worker with /fail")
            if not self.over:
                self.fail(f"worker {worker_id} failed its pre-flight check: {reason}")

    def may_upload(self, worker_id: str, round_id: int | None = None) -> None:
        """Refused unless the caller is the ready round's rank 0 (of round `round_id`, where
        given): asked before an upload's body is read, so nobody else makes the master buffer it."""
        with self.lock:
            self.rounds.member_of_ready_round(worker_id, round_id, rank0=True)

    def upload_model(self, worker_id: str, step: int, data: bytes) -> bool:
        with self.lock:
            self.rounds.member_of_ready_round(worker_id, rank0=True)
            if not self.dispatcher.finished or step != self.ledger.applied_step:
                return False
            self.ledger.finalize_through(step)
            self._audit_written()
            self.final_model = data
            if self.state == JobState.RUNNING:
                # Rank 0 sent its checkpoints before the model, but the steps that make the newest
                # ones final may have been reported only now, and no tick hands over anything once
                # the job is over: handed over here, or a late epoch's checkpoint (and with it its
                # validation, and a --keep-best run's best checkpoint) would be dropped.
                self._hand_over_checkpoints()
                self.state = JobState.SUCCEEDED
                self._event(EventKind.JOB_SUCCEEDED, worker=worker_id, step=step)
            return True

    # -- the operator -------------------------------------------------------------------------------
    def scale(self, target: int) -> None:
        with self.lock:
            if self.over:
                raise ValueError(f"the job has ended ({self.state}); there is nothing to scale")
            self.membership.scale(target)

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
                self._event(EventKind.STOP_REQUESTED, step=self.ledger.applied_step)
            return self.status()

    def preempt(self, timeout_s: float) -> None:
        """SIGTERM to the master: as the operator's stop, but within `timeout_s` and ending
        PREEMPTED. A job without checkpoints, or with no round trained yet, has nothing to save:
        it ends at once, saying so."""
        with self.lock:
            if self.over:
                return
            now = time.time()
            if self.stop_request is not None:
                self.stop_request.preempt(now, timeout_s)
            elif self.checkpoints.enabled and self.ready_round is not None:
                self.stop_request = new_stop_request(now, self.ledger.applied_step, StopCause.PREEMPTION, timeout_s)
                self._event(EventKind.STOP_REQUESTED, "SIGTERM: the master checkpoints its next step and yields",
                            step=self.ledger.applied_step)
            else:
                why = "takes no checkpoints (--checkpoint-steps 0)" if not self.checkpoints.enabled else "had no round training yet"
                self.state, self.failure = JobState.PREEMPTED, f"no checkpoint on SIGTERM: the job {why}"
                self._event(EventKind.PREEMPTED, self.failure, step=self.ledger.applied_step)

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
            cause = self.stop_request.cause
            self.state, self.failure = cause.end_state, problem
            self._event(cause.end_event, problem or f"{cause.end_state} after the checkpoint of step {step}", step=step)

    # -- supervision ------------------------------------------------------------------------------
    def request_regroup(self, cause: str) -> None:
        self.rounds.request_regroup(cause)

    def on_exit(self, exit_: WorkerExit) -> None:
        self.membership.on_exit(exit_, self.over, self.round.members if self.round else [])
        preempting = self.stop_request is not None and self.stop_request.cause is StopCause.PREEMPTION
        holders = self.ready_round.members if self.ready_round else []
        if preempting and not self.over and not any(self.membership.workers[w].alive for w in holders):
            # Every worker that held the model left too (a node drain): no checkpoint can come now.
            self.fail(f"every worker of round {self.ready_round_id} left too")

    def tick(self) -> None:
        with self.lock:
            if self.lock.writes.error:
                self.fail(self.lock.writes.error)
            for exit_ in self.backend.poll():
                self.on_exit(exit_)
            if self.over:
                return
            self._hand_over_checkpoints()
            now = time.time()
            if not self.rounds.checkpoints_in_writing:  # one being written decides the stop when written (_write_checkpoint)
                self._maybe_stop([], now)
            if self.over:
                return
            self.membership.check_silence(now, self.round)
            self.rounds.propose(now, startup_over=now - self.started_at > self.timeouts.startup_grace_s)
            shortage = self.membership.shortage()
            if shortage is not None:
                self.fail(shortage)

    def _hand_over_checkpoints(self) -> None:
        """Under the lock: queue the writes of the complete pairs of final steps."""
        handed = self.checkpoints.hand_over(self.ledger.final_step) if self.checkpoints else []
        for pair in handed:
            # Written in order after the audit lines of the steps it covers (queued earlier);
            # it counts (its event, a stop's end) once written, as a PS job's can be skipped.
            self.rounds.checkpoints_in_writing += 1
            self.lock.writes.put(f"write the checkpoint of step {pair.step}", lambda pair=pair: self._write_checkpoint(pair))

    def _write_checkpoint(self, pair) -> None:
        """Off the lock (a queued write): record the checkpoint, then count it. A PS job's record
        returns False when the shards had no cut of its step (ps_checkpoints.py): no event, no
        restore point, and a stop waiting on it asks rank 0 for another checkpoint."""
        try:
            taken = self.checkpoints.on_checkpoint(pair.step, pair.epoch, pair.state, pair.ledger) is not False
        except BaseException:
            with self.lock:
                self.rounds.checkpoints_in_writing -= 1  # the write's error fails the job at the next tick
            raise
        with self.lock:
            self.rounds.checkpoints_in_writing -= 1
            if taken:
                self._event(EventKind.CHECKPOINT, step=pair.step, epoch=pair.epoch)
                # The newest committed checkpoint is where the group goes back to if every worker
                # holding the model dies (rounds.py): kept here, so no store is read under the lock.
                if self.rounds.restore_point is not None:
                    self.rounds.restore_point = RestorePoint(
                        pair.step, InitialState("checkpoint", pair.state, pair.step), pair.ledger, pair.rows_final,
                        pair.worker_rows)
            elif self.stop_request is not None:
                self.stop_request.skipped(pair.step)
            self._maybe_stop([(pair.step, pair.epoch)] if taken else [], time.time())

    # -- status -------------------------------------------------------------------------------------
    def status(self) -> dict:
        with self.lock:
            return job_status(self)


def engine_mismatch(worker_id: str, engine: EngineVersion | None) -> str | None:
    """Why a worker running `engine` cannot join this master's rounds, or None when it can."""
    ours = this_engine()
    if engine == ours:
        return None
    theirs = str(engine) if engine else "an elastic-step release that does not say which"
    return (f"worker {worker_id} runs {theirs}, its master runs {ours}: give the workers the master's image "
            "(--image or ELASTIC_STEP_IMAGE; by default they get the master pod's own) or run the master from theirs")
