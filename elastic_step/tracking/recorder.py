"""Everything a training job records in MLflow, wired to the master's hooks: parameters, per-step
metrics, membership events, checkpoints (with validation metrics at each epoch end), plots, and
the final model. Every call goes through the run's uploader, so MLflow being slow or away never
stalls training."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time

from elastic_step.durable import write_json_atomic
from elastic_step.ps.api import ShardsStopped
from elastic_step.tracking.checkpoints import Checkpoint, CheckpointStore, parse_best_rule
from elastic_step.tracking.handover import step_tracking_uri, take_task_run
from elastic_step.tracking.run import RunOutcome, RunTracker, TrackingError, connect, default_tracking_uri
from elastic_step.tracking.step_metrics import StepMetrics
from elastic_step.tracking.tensorboard import TENSORBOARD_DIR, TensorBoardLog
from elastic_step.tracking.uri import redact

log = logging.getLogger("elastic_step.tracking")

RUN_ID = re.compile(r"^[0-9a-f]{32}$")
FINAL_MODEL_ARTIFACTS = "elastic_step_model"  # model.bin + model.json of the finished job
# Membership events counted as MLflow metrics (each logged as the running count).
HISTORY_COUNTS = {"relaunched": "relaunches", "regrouped": "regroups", "died": "worker_deaths", "dropped": "workers_dropped",
                  "restored": "restores"}


def model_def_digest(model_def) -> str:
    """sha256 of the model definition's source file ("" when it has none)."""
    path = getattr(model_def.module, "__file__", None)
    if not path or not os.path.exists(path):
        return ""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# The MLflow run the job folder's newest attempt trains, written once the run is open and kept
# after the master ends (master.json goes with it): how a retry of the same command finds its run.
RUN_RECORD = "mlflow_run.json"


def previous_attempt_run(job_dir: str) -> str | None:
    """The MLflow run an earlier attempt in this job folder trained, as it recorded it (None when
    there was none, or the file is not one an attempt wrote; the run is checked to be this job's
    before it is continued)."""
    try:
        with open(os.path.join(job_dir, RUN_RECORD), encoding="utf-8") as f:
            run_id = json.load(f)["run_id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return run_id if isinstance(run_id, str) and RUN_ID.match(run_id) else None


def job_params(config, manifest, model_def=None) -> dict:
    """Everything in the job's configuration, plus what identifies its data and model; the
    tracking URI without its credentials."""
    skip = {"worker_env", "progress", "resume"}
    params = {k: v for k, v in vars(config).items() if k not in skip and v is not None}
    if params.get("mlflow_uri"):
        params["mlflow_uri"] = redact(params["mlflow_uri"])
    params.update(data_content_hash=manifest.content_hash, train_rows=manifest.rows("train"), features=len(manifest.features),
                  rows_per_task=config.rows_per_task)
    if model_def is not None:
        params["model_def_sha256"] = model_def_digest(model_def)
    return params


class TrainingRecorder:
    def __init__(self, config, manifest, trainer, model_def):
        self.config, self.manifest, self.trainer, self.model_def = config, manifest, trainer, model_def
        # One trainer, two users (epoch validation on the uploader thread, the final evaluation
        # and model logging on the main thread): each loads its weights and uses them under this.
        self.trainer_lock = threading.Lock()
        # A pipeline step without a URI, or with one that did not come with its credentials, is refused.
        self.uri = step_tracking_uri(config.mlflow_uri) or default_tracking_uri(config.job_dir)
        self.shown_uri = redact(self.uri)  # what may be printed, logged or stored
        self.client = connect(self.uri, config.job_dir)
        # A SQLite store has no artifact server: artifacts go in a folder beside the database
        # (MLflow's default would be ./mlruns under whatever the current directory is).
        artifacts = None
        if self.uri.startswith("sqlite:///"):
            artifacts = os.path.join(os.path.dirname(os.path.abspath(self.uri[len("sqlite:///"):])), "mlartifacts")
        # Under KFP's MLflow integration the run is a child of the task's run, in its experiment.
        task = take_task_run(self.uri)
        self.tracker = RunTracker(self.client, config.experiment, config.job_name, artifacts, config.pipeline_run_id,
                                  experiment_id=task.experiment_id if task else None)
        self.params = job_params(config, manifest, model_def)
        # Reopening a run first checks that its data, model and task size are this job's.
        # A retry of the same command continues the run its earlier attempt left unfinished.
        parent = config.parent_run_id or (task.run_id if task else None)
        self.resumed = self.tracker.start(resume=config.resume, parent_run_id=parent, params=self.params,
                                          previous=previous_attempt_run(config.job_dir))
        os.makedirs(config.job_dir, exist_ok=True)
        write_json_atomic(os.path.join(config.job_dir, RUN_RECORD), {"run_id": self.run_id, "tracking_uri": self.shown_uri})
        self.checkpoints = CheckpointStore(self.tracker, os.path.join(config.job_dir, "checkpoints"), config.keep_checkpoints,
                                           keep_best=parse_best_rule(config.keep_best) if config.keep_best else None,
                                           sync_before_commit=[config.audit] if config.audit else [])
        self._evaluated_epoch = 0
        self._finished = False
        self._counts: dict[str, int] = {}
        self.tensorboard = TensorBoardLog(config.job_dir)
        # A reopened run's steps already logged are not logged again (step_metrics.py).
        self.step_metrics = StepMetrics(self.tracker.log_metric, self.tensorboard,
                                        logged_through=self._logged_steps() if self.resumed else 0)

    @property
    def run_id(self) -> str:
        return self.tracker.run_id

    @property
    def error(self) -> str | None:
        """Set once MLflow refused a record for good (the job must fail)."""
        return self.tracker.uploader.error

    # -- where the first state comes from ------------------------------------------------------
    def resume_checkpoint(self) -> Checkpoint | None:
        return self.checkpoints.latest() if self.resumed else None

    def lineage_warm_start(self) -> str | None:
        """The warm start the reopened run was started from (its `init_from` parameter), so that an
        attempt that starts it over from the beginning starts from the same model."""
        if not self.resumed:
            return None
        return self.client.get_run(self.run_id).data.params.get("init_from") or None

    def warm_start_model(self, source: str) -> bytes:
        """Parameters from `models:/NAME@ALIAS` (or any model URI), a run's newest checkpoint, or
        with `RUN_ID:best` the best checkpoint the run kept (`--keep-best`)."""
        run_id = source[len("runs:/"):].split("/")[0] if source.startswith("runs:/") else source
        try:
            if run_id.endswith(":best") and RUN_ID.match(run_id[:-len(":best")]):
                return self.trainer.model_bytes_of_state(self.checkpoints.best_checkpoint(run_id[:-len(":best")]).state)
            if RUN_ID.match(run_id):
                checkpoint = self.checkpoints.latest(run_id)
                if checkpoint is not None:
                    return self.trainer.model_bytes_of_state(checkpoint.state)
                source = f"runs:/{run_id}/model"
            return self.trainer.model_bytes_of_logged_model(source)
        except Exception as exc:
            raise TrackingError(redact(
                f"--init-from {source!r} cannot be loaded from {self.uri}: {type(exc).__name__}: {str(exc)[:300]}"
            )) from None

    # -- hooks -----------------------------------------------------------------------------------
    def log_params(self, params: dict | None = None) -> None:
        self.tracker.log_params(self.params if params is None else params)

    def _logged_steps(self) -> int:
        """The newest step of the reopened run's per-step metrics (0: none)."""
        return max((m.step for m in self.client.get_metric_history(self.run_id, "loss")), default=0)

    def on_step(self, entry: dict) -> None:
        """Per-step metrics: summarised once a second, each step once (step_metrics.py)."""
        self.step_metrics.add(entry)

    def on_event(self, event: dict) -> None:
        """Restart and recovery history as metrics, where people look for it: recovery seconds
        per round, and running counts of relaunches, deaths and regroups."""
        kind = event["event"]
        if kind == "recovered":
            self.tracker.log_metric("recovery_s", event["seconds"], event.get("round", 0), event["time"])
            self.tensorboard.scalar("membership/recovery_s", event["seconds"], event.get("round", 0), event["time"])
        elif kind == "regrouped":
            self.tracker.log_metric("regroup_world_size", event["world_size"], event["round"], event["time"])
        if kind in HISTORY_COUNTS:
            name = HISTORY_COUNTS[kind]
            self._counts[name] = self._counts.get(name, 0) + 1
            self.tracker.log_metric(name, self._counts[name], self._counts[name], event["time"])
            self.tensorboard.scalar(f"membership/{name}", self._counts[name], self._counts[name], event["time"])

    def run_info(self) -> dict:
        """Where this job's run is, for `get` and the live page: its id, the tracking URI without
        credentials, and a link to the run in the MLflow UI where the URI is a server's."""
        ui = ""
        if self.shown_uri.startswith(("http://", "https://")):
            ui = f"{self.shown_uri.rstrip('/')}/#/experiments/{self.tracker.experiment_id}/runs/{self.run_id}"
        return {"run_id": self.run_id, "experiment_id": self.tracker.experiment_id, "tracking_uri": self.shown_uri, "ui": ui}

    def on_checkpoint(self, step: int, epoch: int, state: bytes, ledger: dict) -> None:
        self.checkpoints.save(Checkpoint(step, epoch, state, ledger))
        if epoch > self._evaluated_epoch and self.manifest.splits.get("val"):
            self._evaluated_epoch = epoch
            self.tracker.uploader.submit(f"validation after epoch {epoch}", lambda: self._validate(step, state))

    def _validate(self, step: int, state: bytes) -> None:
        from elastic_step.evaluation import evaluate

        with self.trainer_lock:
            self.trainer.load_state_bytes(state)
            try:
                metrics = evaluate(self.trainer, self.model_def, self.manifest, "val")
            except ShardsStopped as exc:  # the job's end came first; a shard that is only away is retried
                log.warning("validation of the checkpoint of step %d skipped: %s", step, exc)
                return
        self.checkpoints.validated(step, metrics)  # the best one so far is kept (--keep-best)
        for name, value in metrics.items():
            if name != "rows":
                self.tracker.client.log_metric(self.run_id, f"val_{name}", value, step=step)
                self.tensorboard.scalar(f"validation/{name}", value, step)

    # -- the end ------------------------------------------------------------------------------------
    def evaluate_model(self, model: bytes, split: str = "test") -> dict:
        """Metrics of the given model parameters on a split: the trainer is this caller's alone
        while it loads them and evaluates."""
        from elastic_step.evaluation import evaluate

        with self.trainer_lock:
            self.trainer.load_model_bytes(model)
            return evaluate(self.trainer, self.model_def, self.manifest, split)

    def finish(self, ok: bool, job_dir: str, test_metrics: dict | None = None, outcome: RunOutcome | None = None,
               timeout_s: float = 600.0) -> str | None:
        """Upload events, plots, metrics and (on success) the model; mark the run ended once
        everything queued has reached MLflow: succeeded or failed by `ok`, unless `outcome` says
        stopped or preempted (KILLED, tagged so: the run is resumed by the next attempt). All of it
        within `timeout_s` (a preempted master has its grace period). Returns the logged model's
        URI. Only the first call counts (a job that fails while finishing is not recorded twice)."""
        if self._finished:
            return None
        self._finished = True
        deadline = time.monotonic() + timeout_s
        left = lambda: max(0.0, deadline - time.monotonic())  # noqa: E731
        model_uri = None
        self.step_metrics.flush()
        for name in ("events.jsonl", "metrics.jsonl"):
            path = os.path.join(job_dir, name)
            if os.path.exists(path):
                self.tracker.log_artifact(path)
        # A preempted master has seconds left of its grace: the plot (matplotlib's import alone
        # took 2.5 s of a 3 s exit) and the reports wait for the run's end, which the retry reaches.
        if outcome == RunOutcome.PREEMPTED:
            self.tensorboard.close()  # its scalars reach the disk; the retry appends to the same folder
        else:
            plot = plot_training(job_dir)
            if plot:
                self.tracker.log_artifact(plot, "plots")
            self._log_reports(job_dir, min(60.0, left()))
        for name, value in (test_metrics or {}).items():
            if name != "rows":
                self.tracker.log_metric(f"test_{name}", value, 0)
        self.tracker.flush_metrics()
        drained = self.tracker.uploader.drain(left())
        if ok and drained and outcome is None:
            model_uri = self._log_model(job_dir)
        outcome = outcome or (RunOutcome.SUCCEEDED if ok and drained else RunOutcome.FAILED)
        self.tracker.finish(outcome=outcome, timeout_s=left())
        return model_uri

    def _log_reports(self, job_dir: str, timeout_s: float = 60.0) -> None:
        """The TensorBoard event files (closed, so whole) and the HTML report, as artifacts."""
        from elastic_step.tracking.report_html import write_report

        self.tracker.uploader.drain(timeout_s)  # the last epoch's validation writes its scalars first
        self.tensorboard.close()
        tb_dir = os.path.join(job_dir, TENSORBOARD_DIR)
        if os.path.isdir(tb_dir) and os.listdir(tb_dir):
            self.tracker.log_artifacts(tb_dir, TENSORBOARD_DIR)
        try:
            self.tracker.log_artifact(write_report(job_dir), "plots")
        except Exception as exc:  # a report is no reason to lose the run
            log.warning("no HTML report for %s: %s", job_dir, exc)

    def _log_model(self, job_dir: str) -> str:
        import mlflow
        from mlflow.models import infer_signature

        from elastic_step.data.reader import ShardReader
        from elastic_step.frameworks.model_def import batch_arrays
        from elastic_step.ps.embedding import TABLES_FILE, held_tables, trainer_network, write_tables
        from elastic_step.ps.shard_tables import SHARDS_FOLDER

        split = "test" if self.manifest.rows("test") else "train"
        batch = ShardReader(self.manifest).read(split, 0, 0, min(5, self.manifest.splits[split][0].rows))
        features, _ = batch_arrays(self.model_def, batch, self.manifest.features, self.manifest.label)
        with open(os.path.join(job_dir, "model", "model.bin"), "rb") as f:
            model = f.read()
        with self.trainer_lock:
            self.trainer.load_model_bytes(model)
            outputs = self.trainer.predict(features)
            tables = held_tables(trainer_network(self.trainer))  # a --mode ps model's, from the shards
            if tables:  # beside the weights file, for the release steps (embedding.hold_tables)
                write_tables(os.path.join(job_dir, "model", TABLES_FILE), tables)
            sharded = os.path.isdir(os.path.join(job_dir, "model", SHARDS_FOLDER))  # tables too big to hold whole
            with mlflow.start_run(run_id=self.run_id):
                if sharded:  # served from the shards' snapshots (master/ps_rows.py)
                    from elastic_step.release.sharded_model import log_sharded_model

                    info = log_sharded_model(os.path.join(job_dir, "model"), self.model_def.source, features,
                                             infer_signature(features, outputs), self.manifest, self.trainer.framework)
                else:
                    info = self.trainer.log_mlflow_model(features, infer_signature(features, outputs))
                # The raw parameters too: export rebuilds the model from them and the model
                # definition in any framework, without going through a flavour's loader. The
                # shards' snapshots only once: the pyfunc holds them, here only their manifest.
                log_model_folder(os.path.join(job_dir, "model"), FINAL_MODEL_ARTIFACTS, skip=SHARD_FILES if sharded else ())
        self.client.set_tag(self.run_id, "elastic_step.model_uri", info.model_uri)
        return info.model_uri


SHARD_FILES = ("ps_shards/shard-*.bin",)  # the sharded pyfunc's copies (ps/shard_tables.py), logged once


def log_model_folder(folder: str, artifact_path: str, skip: tuple[str, ...] = ()) -> None:
    """mlflow.log_artifacts of `folder`, leaving out the files whose path (relative to it) matches `skip`."""
    import fnmatch

    import mlflow

    for root, _, files in os.walk(folder):
        for name in files:
            relative = os.path.relpath(os.path.join(root, name), folder)
            if not any(fnmatch.fnmatch(relative, pattern) for pattern in skip):
                where = os.path.dirname(relative)
                mlflow.log_artifact(os.path.join(root, name), f"{artifact_path}/{where}" if where else artifact_path)


def plot_training(job_dir: str) -> str | None:
    """Loss, samples/s and world size over time, as one PNG."""
    path = os.path.join(job_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    if len(steps) < 2:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = steps[0]["time"]
    elapsed = [s["time"] - t0 for s in steps]
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    axes[0].plot(elapsed, [s["loss"] for s in steps])
    axes[0].set_ylabel("loss")
    axes[1].plot(elapsed, [s["samples_per_s"] or 0 for s in steps], linewidth=0.7)
    axes[1].set_ylabel("samples/s")
    axes[2].step(elapsed, [s["world_size"] for s in steps], where="post")
    axes[2].set_ylabel("world size")
    axes[2].set_xlabel("seconds since the first step")
    fig.suptitle(f"training: {os.path.basename(job_dir.rstrip('/'))}")
    fig.tight_layout()
    out = os.path.join(job_dir, "plots", "training.png")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
