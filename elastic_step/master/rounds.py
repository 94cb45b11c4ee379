"""Rounds: who trains together, from which step, and when that changes.

The master proposes a round (an ordered list of members, position = rank) when the first
workers are there, when a member is gone, when a joiner waits and the round is below target, or
when something asked for a regroup (a death, a drop, a scale-in, a failed collective, a lost step
report). Members call in to rendezvous; once every member has, the round *settles*: the member
with the newest step is the state source, the ledger takes its unacknowledged steps and voids any
later ones, every task in flight returns to todo, and the round is ready from that step on.

`Rounds` keeps the newest round and the newest ready one behind the master's one lock. It reads
the membership (membership.py) and changes the ledger, the checkpoint pairing and the dispatcher
only at a settle.
"""

from __future__ import annotations

import time
from typing import Callable

from elastic_step.errors import JobFailed
from elastic_step.master.dispatcher import Dispatcher
from elastic_step.master.ledger import Ledger, StepGap, StepRejected
from elastic_step.master.membership import Membership, Round, WorkerInfo, order_members
from elastic_step.master.pairing import CheckpointPairing
from elastic_step.master.refusals import Conflict, NotAMember
from elastic_step.master.restore import InitialState, RestorePoint, Rollback, restart_from
from elastic_step.protocol import EventKind, Rendezvous, RendezvousReply, RoundState, StepRecord, WorkerState


def inexact(reporter: str, round_id: int, exc: Exception) -> str:
    """Why the job fails when a step cannot be applied exactly once."""
    return (
        f"the step report from {reporter} (round {round_id}) cannot be applied exactly once: {exc}. "
        "The ledger would no longer be exact, so the job stops here; rerun it with --resume to "
        "continue from its newest checkpoint"
    )


def pending_recovery(current: Round | None, cause: tuple[str, float]) -> dict:
    """The new round's cause and cause time, which its first step's recovered event measures
    from. A loss whose round never trained (a replacement joined before the survivors met, and
    a round with it took over) is still being recovered from: the new round inherits it."""
    if current is not None and current.first_step_at is None and current.cause_time:
        return {"cause": current.cause, "cause_time": current.cause_time}
    return {"cause": cause[0], "cause_time": cause[1]}


class Rounds:
    """The newest round and the newest ready one. `ingest(record, members)` takes a step into
    the ledger (the master's, which also counts it everywhere else); `fail(reason)` fails the job;
    `event(kind, message="", **fields)` records what happened."""

    def __init__(self, membership: Membership, dispatcher: Dispatcher, ledger: Ledger, checkpoints: CheckpointPairing,
                 initial_state: InitialState | None, event: Callable[..., None],
                 ingest: Callable[[StepRecord, list[str]], None], fail: Callable[[str], None],
                 restore_point: RestorePoint | None = None):
        self.membership = membership
        self.dispatcher = dispatcher
        self.ledger = ledger
        self.checkpoints = checkpoints
        self.initial_state = initial_state
        # Where the group goes back to if every worker holding the model dies: the job's start
        # or its resumed checkpoint, then the newest checkpoint handed over (MasterState.tick).
        # None: the job fails then. A PS-mode job's shards cannot go back with the ledger alone
        # (restores_on_loss False): its restore point serves only a rollback of the shards too.
        self.restore_point = restore_point
        # Checkpoints handed over whose write is still under way (a queued write, off the lock):
        # each may become the restore point, so no restore picks a point meanwhile.
        self.checkpoints_in_writing = 0
        self.restores_on_loss = True
        self.rollback: Rollback | None = None  # mode ps: the shards are going back to a checkpoint (ps_rollback.py)
        self.round: Round | None = None  # the newest round, ready or still gathering
        self.ready_round: Round | None = None  # the newest round that became ready
        self._counter = 0
        self._regroup_cause: tuple[str, float] | None = None
        self._event = event
        self._ingest = ingest
        self._fail = fail

    @property
    def ready_round_id(self) -> int:
        return self.ready_round.id if self.ready_round else 0

    def member_of_ready_round(self, worker_id: str, round_id: int | None = None, rank0: bool = False) -> Round:
        """The newest ready round, if the caller is a member of it (its rank 0 where `rank0`)."""
        self.membership.live_worker(worker_id)
        ready = self.ready_round
        if ready is None or worker_id not in ready.members:
            raise NotAMember(f"{worker_id} is not a member of the current round; rendezvous first")
        if round_id is not None and round_id != ready.id:
            raise Conflict(f"round {round_id} is over (the current round is {ready.id}); rendezvous again")
        if rank0 and ready.members[0] != worker_id:
            raise NotAMember(f"only rank 0 of round {ready.id} ({ready.members[0]}) may send this, not {worker_id}")
        return ready

    def request_regroup(self, cause: str) -> None:
        if self._regroup_cause is None:
            self._regroup_cause = (cause, time.time())

    def begin_rollback(self, cause: str) -> int:
        """Mode ps: the shards go back to the restore point (ps_rollback.py); no round settles
        until `rollback_ready`. The newest round's id: the shards refuse its pushes and older ones'."""
        self.rollback = Rollback(cause)
        self.request_regroup(cause)
        return self._counter

    def rollback_ready(self, point: RestorePoint) -> None:
        """Every shard holds `point`'s cut again: the next round to settle goes on from it."""
        if self.rollback is not None:
            self.rollback.point = point

    # -- a worker calls in ----------------------------------------------------------------------
    def rendezvous(self, worker: WorkerInfo, step: int, unacked: list[StepRecord], left_round: int) -> RendezvousReply:
        """One look for a live worker of a running job: its round, once ready, or WAIT."""
        current = self.round
        if current is not None and current.ready and current.id <= left_round:
            # The worker left the current round (its collective failed or it saw a regroup
            # flag): that round is over for everyone.
            self.request_regroup(f"{worker.id} left round {current.id}")
            current = None
        if current is None or worker.id not in current.members:
            worker.step, worker.unacked = step, unacked
            return RendezvousReply(status=Rendezvous.WAIT)
        if worker.joined_round != current.id:
            worker.joined_round = current.id
            worker.step, worker.unacked = step, unacked
        workers = self.membership.workers
        if not current.ready and all(workers[m].joined_round == current.id for m in current.members):
            self._settle(current)
        if not current.ready:
            return RendezvousReply(status=Rendezvous.WAIT)
        return RendezvousReply(
            status=Rendezvous.READY,
            round_id=current.id,
            rank=current.members.index(worker.id),
            world_size=len(current.members),
            store_prefix=current.store_prefix,
            source_rank=current.source_rank,
            start_step=current.start_step,
            acked_step=self.ledger.final_step,
            initial_state=current.initial_state,
        )

    def collective_failed(self, worker_id: str, round_id: int, error: str) -> None:
        if self.round is not None and self.round.ready and self.round.id == round_id:
            if worker_id not in self.round.members:
                raise NotAMember(f"{worker_id} is not a member of round {round_id}")
            self._event(EventKind.COLLECTIVE_FAILED, error[:300], worker=worker_id, round=round_id)
            self.request_regroup(f"collective failed on {worker_id}")

    # -- the master's tick ------------------------------------------------------------------------
    def propose(self, now: float, startup_over: bool) -> None:
        """A new round, when one is due and enough workers are there for it."""
        membership = self.membership
        current = self.round
        live = membership.candidates(current)
        cause = self._regroup_cause
        if cause is None:
            if current is None:
                if len(live) >= membership.target or (startup_over and len(live) >= membership.min_workers):
                    cause = ("first round", 0.0)
            else:
                gone = [m for m in current.members if membership.workers[m].state != WorkerState.LIVE]
                joiners = [w for w in live if w.id not in current.members]
                if gone:
                    cause = (f"{', '.join(gone)} gone", now)
                elif joiners and len(current.members) < membership.target:
                    cause = (f"{', '.join(w.id for w in joiners)} joined", 0.0)
        if cause is None or len(live) < membership.min_workers:
            return
        members = order_members(current.members if current else [], live, membership.target)
        self._counter += 1
        self.round = Round(self._counter, members, proposed_at=now, **pending_recovery(current, cause))
        self._regroup_cause = None
        self._event(EventKind.ROUND_PROPOSED, round=self.round.id, members=members, cause=cause[0])

    # -- settle -----------------------------------------------------------------------------------
    def _pick_source(self, current: Round) -> tuple[str, int, int] | None:
        """(initial-state kind or "", source rank, start step) of a round about to settle: the
        member with the newest step; rank 0 loading the initial state while nobody holds one; the
        group restored when every worker that held the newest final step is gone. None: not now
        (the job failed, or a restore waits for the point being written)."""
        steps = [self.membership.workers[m].step for m in current.members]
        if self.rollback is not None:  # none settles before the shards are back at the point
            return self._restore(current, steps, self.rollback) if self.rollback.point is not None else None
        newest = max(steps)
        initial = self.initial_state
        if newest < 0 and initial is not None and initial.step >= self.ledger.final_step:
            return initial.kind, 0, initial.step  # rank 0 loads the checkpoint (resume) or model (warm start)
        if self.ledger.final_step > 0 and newest < self.ledger.final_step:
            if self.checkpoints_in_writing:
                return None  # settles once the newer checkpoint is the restore point (or is not taken)
            return self._restore(current, steps)
        return "", steps.index(newest), max(newest, 0)

    def _restore(self, current: Round, steps: list[int], rollback: Rollback | None = None) -> tuple[str, int, int] | None:
        """Nobody alive holds the model at the newest final step, or the shards went back to a
        checkpoint (`rollback`): go back to the restore point (see restore.py). Its state is
        loaded by rank 0; with none (no checkpoint yet, no warm start) a fresh member, whose
        model is the job's seeded start, is the source."""
        point, final = (rollback.point if rollback else self.restore_point), self.ledger.final_step
        self.rollback = None
        if point is None or not (rollback or self.restores_on_loss) or (point.initial is None and -1 not in steps):
            self._fail(
                f"every worker that held the model state of step {final} is gone (newest survivor is at "
                f"step {max(max(steps), 0)}) and the master has no state to restore; rerun the job with "
                "--resume to continue from its newest checkpoint"
            )
            return None
        lost = self.ledger.applied_step - point.step
        restart_from(point, self.dispatcher, self.ledger)
        self.checkpoints.void_after(point.step)
        self.initial_state = point.initial
        source = f"checkpoint of step {point.step}" if point.step else "the job's start"
        cause = rollback.cause if rollback else f"every worker that held the model state of step {final} is gone"
        self._event(EventKind.RESTORED,
                    f"{cause}: round {current.id} "
                    f"goes on from the master's {source}; {lost} steps are lost and their rows return to the queue",
                    round=current.id, step=point.step, steps_lost=lost)
        if point.initial is not None:
            return point.initial.kind, 0, point.step
        return "", steps.index(-1), 0

    def _settle(self, current: Round) -> None:
        """Every member has called in: pick the state source, settle the ledger, go."""
        picked = self._pick_source(current)
        if picked is None:
            return
        initial, source_rank, start_step = picked
        source = current.members[source_rank]
        if not self._take_source_steps(current, source, start_step):
            return
        voided_rows = self.ledger.void_after(start_step)
        self.checkpoints.void_after(start_step)
        # start_step stays tentative here: until the source has broadcast it, only the source
        # holds it. If the source dies first, the next settle must void it and go on from the
        # survivors' step. It becomes final with the round's first reported step (every rank
        # applied start_step to enter that step's collective).
        try:
            returned = self.dispatcher.return_all(self.membership.died_since_settle)
        except JobFailed as exc:
            self._fail(str(exc))
            return
        self.membership.died_since_settle = set()
        self._make_ready(current, initial, source_rank, start_step)
        self._event(
            EventKind.REGROUPED,
            round=current.id,
            world_size=len(current.members),
            members=current.members,
            start_step=start_step,
            source=source,
            tasks_returned=returned,
            rows_voided=voided_rows,
        )

    def _take_source_steps(self, current: Round, source: str, start_step: int) -> bool:
        """The ledger takes the state source's unacknowledged steps up to `start_step`. False: the
        job failed, since the ledger cannot reach `start_step` exactly."""
        # The source's unacknowledged steps were applied in the round it last trained in, the
        # newest ready one (a worker that missed a ready round holds no newer step than it).
        previous = self.ready_round
        for record in sorted(self.membership.workers[source].unacked, key=lambda r: r.step):
            if self.ledger.applied_step < record.step <= start_step:
                try:
                    self._ingest(record, previous)
                except (StepGap, StepRejected) as exc:
                    self._fail(inexact(source, current.id, exc))
                    return False
        if self.ledger.applied_step < start_step:
            # The source applied steps the master never received and it no longer holds: their
            # rows would go back to todo and be applied to the model a second time.
            self._fail(inexact(source, current.id, StepGap(
                f"the state source is at step {start_step} but holds no record of steps "
                f"{self.ledger.applied_step + 1}..{start_step}")))
            return False
        return True

    def _make_ready(self, current: Round, initial: str, source_rank: int, start_step: int) -> None:
        """The round goes from `start_step`, with its source; its members' unacknowledged steps
        are settled now."""
        current.state, current.ready_at = RoundState.READY, time.time()
        current.source_rank, current.start_step, current.initial_state = source_rank, start_step, initial
        self.ready_round = current
        for member in current.members:
            self.membership.workers[member].unacked = []
