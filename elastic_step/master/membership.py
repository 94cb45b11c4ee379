"""Workers, slots and rounds: who is alive, who trains together, and when to regroup.

A *slot* is a place for one worker (index 0..MAX-1); a slot's worker is relaunched under a new
id (`w<slot>.<attempt>`) when it dies. A *round* is an ordered list of worker ids (position =
rank) proposed by the master and *ready* once every member has called in to rendezvous.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from elastic_step.protocol import ResourceSample, StepRecord, WorkerState


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
    rows_applied: int = 0  # rows of steps it took part in (shown by status)
    resources: ResourceSample | None = None  # its newest heartbeat's figures (CPU, RSS, GPUs)
    exited_at: float | None = None

    @property
    def alive(self) -> bool:
        return self.state != WorkerState.GONE


@dataclass
class Slot:
    index: int
    active: bool = True  # False once scaled in
    attempts: int = 0
    counted_relaunches: int = 0
    worker_id: str | None = None


@dataclass
class Round:
    id: int
    members: list[str]
    proposed_at: float
    cause: str
    cause_time: float
    ready: bool = False
    ready_at: float | None = None
    start_step: int = 0
    source_rank: int = 0
    initial_state: str = ""  # "checkpoint" | "model" when the source loads it from the master
    first_step_at: float | None = None
    # The round's keys in the master's TCPStore. The store itself has no authentication, so the
    # prefix is a secret: 128 random bits, handed out only in the rendezvous reply (behind the
    # job's token) to the round's members. Anyone else who reaches the store cannot find the
    # round's keys, so cannot join its process group and feed it gradients or row ranges.
    store_prefix: str = field(default_factory=lambda: f"round-{secrets.token_hex(16)}/", repr=False)


def worker_id_for(slot: int, attempt: int) -> str:
    return f"w{slot}.{attempt}"


def order_members(previous: list[str], candidates: list[WorkerInfo], size: int) -> list[str]:
    """Survivors keep their relative order (so rank 0 stays rank 0 where it can); joiners
    follow in slot order, so a fresh group's ranks are its slots."""
    alive = {w.id for w in candidates}
    kept = [m for m in previous if m in alive]
    joiners = sorted((w for w in candidates if w.id not in set(kept)), key=lambda w: w.slot)
    return (kept + [w.id for w in joiners])[:size]


def now() -> float:
    return time.time()
