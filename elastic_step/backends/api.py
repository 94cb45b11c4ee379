"""The interface between the master and whatever runs its workers (local processes, pods).

The master decides *what* should run (slots, relaunches, scaling); a backend only launches,
reports exits and stops. Each exit carries the backend's verdict on relaunching, since only the
backend can tell a preemption (relaunch for free) from an out-of-memory kill (never).
"""

from __future__ import annotations

import abc
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Literal

RelaunchPolicy = Literal["count", "free", "never"]


@dataclass
class WorkerExit:
    worker_id: str
    reason: str  # for people: "exited with code 1", "killed by SIGKILL", "OOMKilled (limit 1Gi)"
    returncode: int | None = None
    relaunch: RelaunchPolicy = "count"
    left: bool = False  # it left on SIGTERM (an eviction, a person's kill): a departure, not a failure


@dataclass
class LaunchSpec:
    """What every worker of a job gets: where the master is and how to prove who it is."""

    master_url: str
    token_file: str
    job_dir: str
    env: dict[str, str] = field(default_factory=dict)
    # The ports workers call on the master (API, store), when known: the Kubernetes backend
    # admits its workers to exactly these; empty means every port of the master's pod.
    master_ports: list[int] = field(default_factory=list)


class Backend(abc.ABC):
    name: str

    @abc.abstractmethod
    def launch(self, slot: int, worker_id: str) -> None:
        """Start one worker for `slot` under the id `worker_id`."""

    @abc.abstractmethod
    def poll(self) -> list[WorkerExit]:
        """Exits seen since the last poll (non-blocking)."""

    @abc.abstractmethod
    def stop(self, worker_id: str) -> None:
        """Stop a worker now (it may be hung: do not wait for its cooperation)."""

    @abc.abstractmethod
    def shutdown(self, grace_s: float, members: Collection[str] | None = None) -> None:
        """End every worker: give `members` (every worker when None) `grace_s` to exit on their
        own, then kill the rest. A worker outside `members` (a joiner still starting, a spare)
        holds no rows and no state, and is ended at once instead of being waited for."""

    def describe(self, worker_id: str) -> dict:
        """Backend details shown by `elastic-step status` (pid, pod name, ...)."""
        return {}

    def shard_launcher(self):
        """A --mode ps job's shards, when this backend runs them itself (master/ps_shards.py's
        ShardLauncher); None: they are processes beside the master."""
        return None

    # Whether `publish` shows the job's status anywhere: locally the job folder and the master's
    # own API serve `get`, `top` and `stop`, and nothing needs publishing.
    publishes_status = False

    def publish(self, document: dict) -> dict[str, str]:
        """Show the job's status (`document`: its info, status and membership events) where this
        backend's users read it; returns the operator's requests left there, by name ("stop":
        when, "workers": how many). Called from the master's publishing thread, never under its
        lock; it may wait for the network."""
        return {}
