"""One interface for reading and steering jobs, whatever runs them: the CLI's `list`, `get`,
`top`, `logs`, `stop`, `scale` and `ui` call it and never ask which backend a job is on.
`LocalJobs` (operate/local.py) reads job folders and asks their masters' API; `KubernetesJobs`
(operate/kubernetes.py) reads the status ConfigMaps and pods with the caller's own credentials."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Iterator

PS_MOVE_TIMEOUT_S = 600.0  # `scale --ps`: moving a large table's rows takes a while; the master answers once done


@dataclass(frozen=True)
class LogRequest:
    """Which log, and which of its lines: the master's (`worker` None), or a worker's by id
    (w1.2) or slot (w1: its newest attempt; `previous`: the attempt before)."""

    worker: str | None = None
    previous: bool = False
    tail: int | None = None
    since_s: float | None = None
    timestamps: bool = False
    follow: bool = False


@dataclass(frozen=True)
class LivePage:
    """Where to see a job's live page: its master's own address (`url`), or, where the master
    cannot be reached from here, its published status to serve on this machine (`read`)."""

    describe: str
    url: str | None = None
    read: Callable[[], dict | None] | None = None


class JobOperator(ABC):
    """Reading and steering the jobs of one backend. Every method refuses, in one line, a job it
    does not find or a name several jobs answer to."""

    @abstractmethod
    def jobs(self) -> list[dict]:
        """One row per job: its name, state, age, workers, epoch, progress, samples/s, where."""

    @abstractmethod
    def locate(self, job: str) -> str:
        """The reference that keeps naming the same job (`top` follows it): refuses an unknown
        or ambiguous one at once."""

    @abstractmethod
    def view(self, job: str, with_events: bool = False) -> dict:
        """What `get` shows: {"summary", "workers"[, "events"]}."""

    @abstractmethod
    def stop(self, job: str, timeout_s: float, wait: bool, say: Callable[[str], None]) -> str:
        """Ask the job to stop at a checkpoint; `say` tells progress; the outcome, for people."""

    @abstractmethod
    def scale(self, job: str, workers: int) -> str:
        """Ask the job to run `workers` workers; what was asked, for people."""

    @abstractmethod
    def scale_ps(self, job: str, shards: int) -> dict:
        """Ask a --mode ps job to run `shards` parameter-server shards and wait until its master
        has moved the rows: {"job": its name, "ps_scale": what moved (ps/moves.py's MoveReport)}."""

    @abstractmethod
    def log_lines(self, job: str, request: LogRequest) -> Iterator[str]:
        """The lines of one of the job's logs, followed while it runs when asked."""

    @abstractmethod
    def live_page(self, job: str) -> LivePage:
        """Where the job's live page is."""
