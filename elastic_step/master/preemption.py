"""SIGTERM to the master is a preemption, not a failure (an eviction, a node drain, a spot
shutdown, a higher-priority workload): the master asks rank 0 for a checkpoint of its next step,
saves everything queued to MLflow, marks the run preempted and exits 75 (exit_codes.PREEMPTED),
all within the grace period Kubernetes gives it between SIGTERM and SIGKILL
(defaults.TERMINATION_GRACE_S, `--termination-grace`). This module holds the signal's flag, the
grace period's budget, and how a job that ended early (stopped by its operator, or preempted) is
recorded: result.json, the MLflow run, and the one line it exits with."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

from elastic_step.durable import write_json_atomic
from elastic_step.errors import ElasticStepError, JobPreempted
from elastic_step.exit_codes import ExitCode
from elastic_step.protocol import EventKind, JobState
from elastic_step.tracking.run import RunOutcome

log = logging.getLogger("elastic_step.master")


class Sigterm:
    """Set by the SIGTERM handler, read by the supervision loop. The handler only records the
    signal: the loop acts on it between ticks, never inside one that holds the master's lock."""

    def __init__(self):
        self._event = threading.Event()
        self.at: float | None = None  # time.monotonic() of the first SIGTERM

    def __call__(self, *_) -> None:
        if self.at is None:
            self.at = time.monotonic()
        self._event.set()

    @property
    def received(self) -> bool:
        return self._event.is_set()


@contextlib.contextmanager
def sigterm_as_preemption():
    """Installs the handler for the whole job (a SIGTERM while the job starts is a preemption too)
    and puts the previous one back after."""
    flag = Sigterm()
    previous = signal.signal(signal.SIGTERM, flag)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass(frozen=True)
class GraceBudget:
    """How the master spends its grace period: the checkpoint of the next step within the first
    half; then the workers' exit, MLflow's flush and its own exit, ending `reserve_s` before the
    SIGKILL."""

    grace_s: float

    @property
    def checkpoint_s(self) -> float:
        return self.grace_s / 2

    @property
    def reserve_s(self) -> float:
        return min(3.0, self.grace_s / 10)

    def left(self, sigterm_at: float | None) -> float:
        """Seconds left to finish in (the whole budget when no SIGTERM came)."""
        if sigterm_at is None:
            return 600.0
        return max(1.0, sigterm_at + self.grace_s - self.reserve_s - time.monotonic())


class JobStopped(ElasticStepError):
    """The operator stopped the job (`elastic-step stop`) after its final checkpoint: an end the
    operator asked for, not a failure, so the exit code is 0 and no retry policy undoes it; the
    same command continues it."""

    exit_code = ExitCode.SUCCESS


def end_early(config, recorder, master, started: float, sigterm: Sigterm, budget: GraceBudget) -> None:
    """A job that ended STOPPED or PREEMPTED: everything queued reaches MLflow (the final
    checkpoint first) within what is left of the grace period, the run is marked KILLED and tagged
    with how it ended, result.json says so, and the end is raised as what it is."""
    state = master.state.state
    outcome = RunOutcome.PREEMPTED if state == JobState.PREEMPTED else RunOutcome.STOPPED
    log.info("%s: the workers are gone; saving everything queued to MLflow within %.1fs", state, budget.left(sigterm.at))
    recorder.finish(False, config.job_dir, outcome=outcome, timeout_s=budget.left(sigterm.at))
    log.info("%s: MLflow run %s marked %s", state, recorder.run_id, outcome)
    checkpoints = master.events.of(EventKind.CHECKPOINT)
    newest = checkpoints[-1]["step"] if checkpoints else None
    write_json_atomic(os.path.join(config.job_dir, "result.json"), {
        "state": str(state), "run_id": recorder.run_id, "mlflow_uri": recorder.shown_uri, "job_dir": config.job_dir,
        "checkpoint_step": newest, "steps": master.ledger.applied_step, "seconds": round(time.time() - started, 2),
        "note": master.state.failure or "",
        "recoveries_s": [e["seconds"] for e in master.events.of(EventKind.RECOVERED)],
        "relaunches": len(master.events.of(EventKind.RELAUNCHED)), "regroups": len(master.events.of(EventKind.REGROUPED)),
    })
    where = f"its checkpoint of step {newest}" if newest is not None else "its newest earlier checkpoint, if any"
    how = f"MLflow run {recorder.run_id}, now KILLED, {outcome}"
    if outcome == RunOutcome.STOPPED:
        raise JobStopped(f"job {config.job_name} stopped; `elastic-step train` with the same options and job folder "
                         f"continues it from {where} (--resume insists on it) ({how})")
    missed = f" ({master.state.failure})" if master.state.failure else ""
    raise JobPreempted(f"job {config.job_name} preempted (SIGTERM){missed}; the same command continues it from "
                       f"{where} ({how})")
