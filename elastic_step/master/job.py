"""Running one training job: validate inputs, start the store, the API and the workers,
supervise until the data is applied, then save and evaluate the final model."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from dataclasses import dataclass

from elastic_step.backends.local import warm_parent_for
from elastic_step.config import TrainConfig
from elastic_step.data.manifest import load_manifest, validate_shards
from elastic_step.data.reader import ShardReader
from elastic_step.durable import fsync_path, write_atomic, write_json_atomic
from elastic_step.errors import JobFailed, JobPreempted, ModelDefinitionError
from elastic_step.frameworks.model_def import batch_arrays, load_model_definition
from elastic_step.frameworks.registry import build_trainer
from elastic_step.master.events import show_notable_events
from elastic_step.master.preemption import GraceBudget, Sigterm, end_early, sigterm_as_preemption
from elastic_step.master.progress import ProgressDisplay
from elastic_step.master.ps_tables import check_ps_tables
from elastic_step.master.startup import TOKEN_FILE, Master, start_master, write_final_status
from elastic_step.master.state import MasterState
from elastic_step.protocol import EventKind, JobState
from elastic_step.tracking.recorder import TrainingRecorder
from elastic_step.tracking.run import tracking_errors
from elastic_step.tracking.uri import redact

log = logging.getLogger("elastic_step.master")


@dataclass
class JobResult:
    mlflow_uri: str
    run_id: str
    model_uri: str
    job_dir: str
    model_dir: str
    test_metrics: dict
    steps: int
    rows_audited: int
    recoveries_s: list[float]
    seconds: float
    # The membership history, for a pipeline's Metrics output: relaunched workers, re-formed rounds.
    relaunches: int = 0
    regroups: int = 0

    def to_json(self) -> dict:
        return self.__dict__



# What MLflow accepts as a metric name (mlflow.utils.validation): checked before training, since
# a validation or test metric it rejects would otherwise fail the job at its end.
METRIC_NAME = re.compile(r"^[\w\-./ :]+$")


def check_model_definition(config: TrainConfig, manifest):
    """Import the model definition and run one tiny batch through it here, so a broken one
    fails before any worker starts."""
    model_def = load_model_definition(config.model_def)
    trainer = build_trainer(model_def, seed=config.seed)
    batch = ShardReader(manifest).read("train", 0, 0, min(2, manifest.splits["train"][0].rows))
    try:
        features, labels = batch_arrays(model_def, batch, manifest.features, manifest.label)
        trainer.loss_value(trainer.predict(features), labels)
        names = list(model_def.metrics()) if model_def.metrics is not None else []
    except Exception as exc:
        raise ModelDefinitionError(
            f"model definition {config.model_def!r} fails on a batch of {config.data}: {type(exc).__name__}: {exc}"
        ) from exc
    for name in names:
        if not METRIC_NAME.match(f"val_{name}"):
            raise ModelDefinitionError(
                f"model definition {config.model_def!r}: metrics() key {name!r} is not a name MLflow accepts; "
                "rename it with letters, digits, _ - . / : and spaces only"
            )
    return model_def, trainer


def run_job(config: TrainConfig) -> JobResult:
    """Check the inputs, open the MLflow run, start the master, supervise until the data is
    applied (or the job fails, is stopped or preempted), then save, evaluate and record the model."""
    started = time.time()
    budget = GraceBudget(config.termination_grace)
    show_notable_events()
    with sigterm_as_preemption() as sigterm, contextlib.ExitStack() as early:
        # The workers' warm parent imports torch beside the checks and MLflow's start-up below
        # (it writes nothing until its first worker: a bad input leaves no trace of it).
        warm_parent = early.enter_context(warm_parent_for(config, os.path.join(config.job_dir, TOKEN_FILE)))
        manifest, model_def, trainer = check_inputs(config)
        if config.backend == "kubernetes":  # the cluster's refusal comes before an MLflow run is opened
            from elastic_step.backends.kubernetes.options import settings_from_config
            from elastic_step.backends.kubernetes.preflight import check_before_start

            check_before_start(settings_from_config(config).namespace)
        if sigterm.received:
            raise JobPreempted(f"job {config.job_name} preempted (SIGTERM) before it started; the same command starts it")
        # MLflow first: unreachable tracking, or a run that cannot be resumed with these inputs, is
        # an error before any port is bound or worker starts.
        with tracking_errors(f"job {config.job_name}"):
            recorder = TrainingRecorder(config, manifest, trainer, model_def)
        try:
            with tracking_errors(f"job {config.job_name}"):
                with contextlib.ExitStack() as running:
                    master = start_master(config, manifest, recorder, running, warm_parent)
                    supervise(master.state, recorder, config.progress, sigterm, budget)
                write_final_status(config.job_dir, master.state)
                if master.state.state in (JobState.STOPPED, JobState.PREEMPTED):
                    end_early(config, recorder, master, started, sigterm, budget)
                if master.state.state != JobState.SUCCEEDED:
                    raise JobFailed(f"job {config.job_name} failed: {master.state.failure}")
                return finish_job(config, manifest, recorder, trainer, master, started)
        except BaseException:
            try:  # the run is FAILED (and resumable), never left RUNNING; a stop or preemption is recorded already
                recorder.finish(False, config.job_dir, timeout_s=budget.left(sigterm.at))
            except Exception as exc:
                log.error("could not record the failure in MLflow: %s", redact(str(exc)[:300]))
            raise


def check_inputs(config: TrainConfig):
    """The data and the model definition, checked before anything starts."""
    manifest = load_manifest(config.data)
    validate_shards(manifest, [s for s in ("train", "val", "test") if manifest.splits.get(s)])
    model_def, trainer = check_model_definition(config, manifest)
    check_ps_tables(config, trainer)
    os.makedirs(config.job_dir, exist_ok=True)
    return manifest, model_def, trainer


def supervise(state: MasterState, recorder: TrainingRecorder, show_progress: bool, sigterm: Sigterm,
              budget: GraceBudget) -> None:
    """Launch the workers and tick the master until the job is over. SIGTERM is a preemption: the
    job checkpoints its next step within the grace period's first half and ends PREEMPTED. Ctrl-C
    and MLflow refusing a record for good each fail the job."""
    progress = ProgressDisplay(enabled=show_progress)
    preempting = False
    try:
        if not sigterm.received:  # a SIGTERM while the job started: no worker is launched to be stopped
            state.launch_all()
        with progress:
            while not state.over:
                if sigterm.received and not preempting:
                    preempting = True
                    log.warning("SIGTERM: checkpointing the next step within %.0fs, then yielding", budget.checkpoint_s)
                    state.preempt(max(0.0, sigterm.at + budget.checkpoint_s - time.monotonic()))
                state.tick()
                if recorder.error:
                    state.fail(recorder.error)
                if progress.due():  # the status is built only when it is shown
                    progress.update(state.status())
                state.wait_for_work(0.05)  # a failed collective ends the pause: its regroup is proposed at once
            progress.update(state.status())
    except KeyboardInterrupt:
        state.fail("interrupted")


def save_model(config: TrainConfig, manifest, trainer, model: bytes, steps: int) -> str:
    """The final model's parameters and description in JOB_DIR/model, each file replaced whole."""
    model_dir = os.path.join(config.job_dir, "model")
    os.makedirs(model_dir, exist_ok=True)
    write_atomic(os.path.join(model_dir, "model.bin"), model)
    write_json_atomic(os.path.join(model_dir, "model.json"), {
        "framework": trainer.framework, "model_def": config.model_def, "steps": steps,
        "data": manifest.root, "content_hash": manifest.content_hash,
    })
    return model_dir


def finish_job(config: TrainConfig, manifest, recorder: TrainingRecorder, trainer, master: Master, started: float) -> JobResult:
    state, ledger = master.state, master.ledger
    model_dir = save_model(config, manifest, trainer, state.final_model, ledger.applied_step)
    metrics = recorder.evaluate_model(state.final_model, "test")
    model_uri = recorder.finish(True, config.job_dir, metrics)
    if recorder.error:
        raise JobFailed(f"job {config.job_name} failed: {recorder.error}")
    result = JobResult(
        mlflow_uri=recorder.shown_uri, run_id=recorder.run_id, model_uri=model_uri or "",
        job_dir=config.job_dir, model_dir=model_dir, test_metrics=metrics, steps=ledger.applied_step,
        rows_audited=ledger.rows_final, recoveries_s=[e["seconds"] for e in master.events.of(EventKind.RECOVERED)],
        seconds=round(time.time() - started, 2),
        relaunches=len(master.events.of(EventKind.RELAUNCHED)), regroups=len(master.events.of(EventKind.REGROUPED)),
    )
    if config.audit and os.path.exists(config.audit):
        fsync_path(config.audit)  # the audit is whole on disk before the result vouches for it
    write_json_atomic(os.path.join(config.job_dir, "result.json"), result.to_json())
    return result
