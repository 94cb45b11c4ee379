"""Membership: which workers this job has, which are alive, and when one is given up.

A *slot* is a place for one worker (index 0..MAX-1); a slot's worker is relaunched under a new
id (`w<slot>.<attempt>`) when it dies, up to `max_relaunches` counted relaunches per slot. A
*round* is an ordered list of worker ids (position = rank) proposed by the master and *ready*
once every member has called in to rendezvous (rounds.py decides those).

`Membership` keeps the slots and workers behind the master's one lock: launches, registration,
heartbeats, exits and relaunches, drops of hung or absent workers (the silence clocks), scaling,
and whether enough workers are left. It asks for a regroup through the callable it is given and
records what happened as events; it never decides a round itself.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Callable

from elastic_step import defaults
from elastic_step.backends.api import Backend, WorkerExit
from elastic_step.master.refusals import NotAMember
from elastic_step.protocol import EventKind, ResourceSample, RoundState, StepRecord, WorkerState


@dataclass
class WorkerInfo:
    id: str
    slot: int
    launched_at: float
    state: WorkerState = WorkerState.LAUNCHED
    last_seen: float = 0.0
    pid: int = 0
    host: str = ""
    step: int = -1  # newest step it applied, as of its last rendezvous or heartbeat
    joined_round: int = 0  # the round it has called in for
    # It has called in to rendezvous, so its model definition is imported and its trainer
    # built: it can train now. Registration alone says only that the process started.
    ready: bool = False
    unacked: list[StepRecord] = field(default_factory=list)
    exit_reason: str = ""
    resources: ResourceSample | None = None  # its newest heartbeat's figures (CPU, RSS, GPUs)
    exited_at: float | None = None
    dropped: bool = False  # the master gave it up and asked the backend to stop it: once

    @property
    def alive(self) -> bool:
        return self.state != WorkerState.GONE


@dataclass
class Slot:
    index: int
    active: bool = True  # False once scaled in
    attempts: int = 0
    counted_relaunches: int = 0
    free_relaunches: int = 0  # after departures, not charged (up to max_free_relaunches)
    worker_id: str | None = None


@dataclass
class Round:
    id: int
    members: list[str]
    proposed_at: float
    cause: str
    cause_time: float
    state: RoundState = RoundState.GATHERING
    ready_at: float | None = None
    start_step: int = 0
    source_rank: int = 0
    initial_state: str = ""  # "checkpoint" | "model" when the source loads it from the master
    first_step_at: float | None = None
    # member -> the newest step it said (heartbeat) it applied in this round: a step every member
    # holds is final, whether or not the next one has been reported yet (MasterState.heartbeat).
    held: dict[str, int] = field(default_factory=dict)
    # The round's keys in the master's TCPStore. The store itself has no authentication, so the
    # prefix is a secret: 128 random bits, handed out only in the rendezvous reply (behind the
    # job's token) to the round's members. Anyone else who reaches the store cannot find the
    # round's keys, so cannot join its process group and feed it gradients or row ranges.
    store_prefix: str = field(default_factory=lambda: f"round-{secrets.token_hex(16)}/", repr=False)

    @property
    def ready(self) -> bool:
        return self.state == RoundState.READY


def worker_id_for(slot: int, attempt: int) -> str:
    return f"w{slot}.{attempt}"


def order_members(previous: list[str], candidates: list[WorkerInfo], size: int) -> list[str]:
    """Survivors keep their relative order (so rank 0 stays rank 0 where it can); joiners
    follow in slot order, so a fresh group's ranks are its slots."""
    alive = {w.id for w in candidates}
    kept = [m for m in previous if m in alive]
    joiners = sorted((w for w in candidates if w.id not in set(kept)), key=lambda w: w.slot)
    return (kept + [w.id for w in joiners])[:size]


class Membership:
    """The job's slots and workers. `event(kind, message="", **fields)` records what happened;
    `regroup(cause)` asks for a new round."""

    def __init__(self, backend: Backend, min_workers: int, max_workers: int, max_relaunches: int, timeouts,
                 event: Callable[..., None], regroup: Callable[[str], None], spares: int = 0,
                 max_free_relaunches: int = defaults.MAX_FREE_RELAUNCHES):
        self.backend = backend
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.max_relaunches = max_relaunches
        self.max_free_relaunches = max_free_relaunches
        self.timeouts = timeouts
        self.target = max_workers
        # Warm spares: slots beyond the target whose workers start, import, warm up and wait at
        # the rendezvous. A round never takes more than `target` members, so they hold no task;
        # when a member is gone, the next round takes a ready spare in its place (a joiner that
        # needs no start-up), and the dead member's slot is relaunched as the next spare.
        self.spares = spares
        self.slots = [Slot(i) for i in range(max_workers + spares)]
        self.workers: dict[str, WorkerInfo] = {}
        # Workers that died since the last settle: the tasks they held count a failure then.
        self.died_since_settle: set[str] = set()
        self._event = event
        self._regroup = regroup
        self._last_tick = time.time()

    # -- launching ------------------------------------------------------------------------------
    def launch_all(self) -> None:
        for slot in self.slots:
            self.launch(slot)

    def launch(self, slot: Slot) -> None:
        slot.attempts += 1
        worker_id = worker_id_for(slot.index, slot.attempts)
        slot.worker_id = worker_id
        self.workers[worker_id] = WorkerInfo(worker_id, slot.index, launched_at=time.time())
        self.backend.launch(slot.index, worker_id)
        self._event(EventKind.LAUNCHED, worker=worker_id, slot=slot.index, attempt=slot.attempts)

    # -- who is calling -------------------------------------------------------------------------
    def live_worker(self, worker_id: str) -> WorkerInfo:
        """The caller as a live worker of this job (and heard from now), or refused."""
        worker = self.workers.get(worker_id)
        if worker is None or not worker.alive:
            raise NotAMember(
                f"{worker_id!r} is not a live worker of this job (it was never launched by this master, "
                "or it is an earlier attempt's worker that is gone); it must stop"
            )
        worker.last_seen = time.time()
        return worker

    def seen(self, worker_id: str) -> WorkerInfo | None:
        """The caller, if this job ever launched it, heard from now."""
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.last_seen = time.time()
        return worker

    def register(self, worker_id: str, pid: int, host: str) -> bool:
        worker = self.workers.get(worker_id)
        if worker is None or not worker.alive:
            return False
        worker.state = WorkerState.LIVE if worker.state == WorkerState.LAUNCHED else worker.state
        worker.last_seen = time.time()
        worker.pid, worker.host = pid, host
        self._event(EventKind.JOINED, worker=worker_id, pid=pid)
        return True

    def heartbeat(self, worker_id: str, step: int, resources: ResourceSample | None, job_over: bool) -> bool:
        """Take a heartbeat; True when the worker is to stop."""
        worker = self.seen(worker_id)
        stop = worker is None or not worker.alive or worker.state == WorkerState.RETIRING or job_over
        if worker is not None and step > worker.step:
            worker.step = step
        if worker is not None and worker.alive and resources is not None:
            if worker.resources is None or resources.time >= worker.resources.time:
                worker.resources = resources  # the newest sample only
        return stop

    # -- exits and relaunches -------------------------------------------------------------------
    def on_exit(self, exit_: WorkerExit, job_over: bool, members: list[str]) -> None:
        """A worker's process or pod ended (`members`: the newest round's)."""
        worker = self.workers.get(exit_.worker_id)
        if worker is None:
            return
        was_member = worker.id in members
        retiring = worker.state == WorkerState.RETIRING
        worker.exit_reason = exit_.reason
        worker.exited_at = worker.exited_at or time.time()
        if worker.state != WorkerState.GONE:
            worker.state = WorkerState.GONE
            if not job_over and not retiring and exit_.relaunch != "free":  # the cluster took it: not the data's fault
                self.died_since_settle.add(worker.id)
        if job_over:
            return
        if retiring or exit_.left:
            self._event(EventKind.LEFT, worker=worker.id, reason=exit_.reason)
        else:
            self._event(EventKind.DIED, worker=worker.id, reason=exit_.reason, returncode=exit_.returncode)
        if was_member:
            self._regroup(f"{worker.id} {exit_.reason}")
        slot = self.slots[worker.slot]
        if retiring or not slot.active or slot.worker_id != worker.id:
            return
        # A departure's relaunch is free while the slot has free ones left, then charged like any other.
        free = exit_.relaunch == "free" and slot.free_relaunches < self.max_free_relaunches
        if exit_.relaunch == "never":
            self._event(EventKind.NOT_RELAUNCHED, f"{worker.id} {exit_.reason}", worker=worker.id)
        elif free or slot.counted_relaunches < self.max_relaunches:
            slot.free_relaunches += free
            slot.counted_relaunches += not free
            # counted: whether this relaunch is charged against --max-relaunches (slot_relaunches: the slot's charged ones so far)
            self._event(EventKind.RELAUNCHED, worker=worker.id, slot=slot.index, counted=not free,
                        slot_relaunches=slot.counted_relaunches)
            self.launch(slot)
        else:
            also = f" and its {self.max_free_relaunches} free ones after departures" if exit_.relaunch == "free" else ""
            self._event(EventKind.SLOT_EXHAUSTED, f"slot {slot.index} used its {self.max_relaunches} relaunches{also}")

    def drop(self, worker: WorkerInfo, reason: str) -> None:
        """A worker that is alive but useless (hung, or missing at rendezvous): kill it; its exit
        then counts as a death. Once: until the backend reports that exit, every later tick finds
        it as silent or as absent as before, and dropping it again would only repeat the event
        (every 50 ms while a round waits for it) and the backend's stop."""
        if worker.dropped:
            return
        worker.dropped = True
        self._event(EventKind.DROPPED, reason, worker=worker.id)
        self.backend.stop(worker.id)

    # -- silence clocks -------------------------------------------------------------------------
    def check_silence(self, now: float, pending: Round | None) -> None:
        """Drop workers silent past the heartbeat timeout, and members of the `pending` round
        (proposed, not ready) that have not called in within the rendezvous timeout."""
        self._forgive_silence_while_paused(now, pending)
        for worker in self.workers.values():
            allowed = self.timeouts.heartbeat_s if worker.ready else max(self.timeouts.heartbeat_s, self.timeouts.warm_up_s)
            if worker.state in (WorkerState.LIVE, WorkerState.RETIRING) and now - worker.last_seen > allowed:
                warming = "" if worker.ready else ", warming up"
                self.drop(worker, f"{worker.id} sent no heartbeat for {allowed:.0f}s (hung{warming})")
        if pending is not None and not pending.ready and now - pending.proposed_at > self.timeouts.rendezvous_s:
            for member in pending.members:
                worker = self.workers[member]
                if worker.joined_round != pending.id and worker.alive:
                    self.drop(worker, f"{member} did not join round {pending.id} within {self.timeouts.rendezvous_s:.0f}s")

    def _forgive_silence_while_paused(self, now: float, pending: Round | None) -> None:
        """The master ticks every 50 ms. A gap of half the heartbeat timeout means the master
        itself was not running (its machine paused or snapshotted, the process stopped): the
        workers' silence over that gap is not theirs, so nobody is dropped for it, neither as hung
        nor as missing at a pending rendezvous. (Seen on a VM snapshot: a 155 s pause, after which
        every worker looked hung and the job failed.)"""
        gap, self._last_tick = now - self._last_tick, now
        if gap > self.timeouts.heartbeat_s / 2:
            self._event(EventKind.MASTER_PAUSED, seconds=round(gap, 3))
            # Every silence clock restarts; a truly hung or absent worker is dropped a timeout later.
            for worker in self.workers.values():
                worker.last_seen = now
            if pending is not None and not pending.ready:
                pending.proposed_at = now

    # -- size -----------------------------------------------------------------------------------
    def scale(self, target: int) -> None:
        if not self.min_workers <= target <= self.max_workers:
            raise ValueError(f"--workers {target} is outside this job's range {self.min_workers}:{self.max_workers}")
        self.target = target
        self._event(EventKind.SCALED, target=target)
        for slot in self.slots:
            want = slot.index < target + self.spares
            if want and not slot.active:
                slot.active = True
                slot.counted_relaunches = slot.free_relaunches = 0
                self.launch(slot)
            elif not want and slot.active:
                slot.active = False
                worker = self.workers.get(slot.worker_id or "")
                if worker is not None and worker.alive:
                    worker.state = WorkerState.RETIRING
                    self._regroup(f"scaled in: {worker.id} retires")

    def shortage(self) -> str | None:
        """Why the job cannot go on for want of workers, or None while enough are left."""
        alive = [w for w in self.workers.values() if w.alive and w.state != WorkerState.RETIRING]
        if len(alive) >= self.min_workers:
            return None
        reasons = "; ".join(f"{w.id} {w.exit_reason}" for w in self.workers.values() if w.exit_reason)
        return (f"only {len(alive)} workers left and fewer than --workers minimum {self.min_workers}, "
                f"no relaunches left (--max-relaunches {self.max_relaunches}): {reasons}")

    def is_spare(self, worker: WorkerInfo, current: Round | None) -> bool:
        """A live worker, ready to train, that the full current round leaves waiting."""
        return (worker.state == WorkerState.LIVE and worker.ready and current is not None
                and worker.id not in current.members and len(current.members) >= self.target)

    def candidates(self, current: Round | None) -> list[WorkerInfo]:
        """The live workers a new round may take. Once training runs, a worker takes part only
        when it is ready to train: a joiner that has registered but still imports its framework
        (TensorFlow: seconds) would otherwise hold every survivor at the rendezvous until it is
        done. The first round has no survivors to hold up, so it takes every registered worker,
        as do rounds re-formed from members that never became ready (a first round that lost one)."""
        live = [w for w in self.workers.values() if w.state == WorkerState.LIVE]
        if current is not None:
            live = [w for w in live if w.ready or w.id in current.members]
        return live
