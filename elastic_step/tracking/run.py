"""One MLflow run per training job: found again by its tags when the job (or a retried pipeline
step) resumes, nested under a pipeline's parent run when one is given."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from enum import StrEnum

from elastic_step.errors import ConfigError, ElasticStepError
from elastic_step.tracking.sqlite_schema import seed_database
from elastic_step.tracking.uploader import Uploader
from elastic_step.tracking.uri import redact, use_tracking_uri

log = logging.getLogger("elastic_step.tracking")

JOB_TAG = "elastic_step.job"
PIPELINE_RUN_TAG = "elastic_step.pipeline_run_id"
# What finds a job's run again: a digest of the job name and pipeline run id, so that no name
# (quotes, backticks, anything) ever goes into a search filter; the tags themselves are then
# compared exactly.
JOB_KEY_TAG = "elastic_step.job_key"

# How the job's attempt on a run ended, beside MLflow's own status (which has no word for a
# preemption): what `get` and the release gate read.
STATE_TAG = "elastic_step.state"


class RunOutcome(StrEnum):
    """A training run's `elastic_step.state` tag, and the MLflow status each one sets."""

    RUNNING = "running"  # an attempt is training it
    SUCCEEDED = "succeeded"  # FINISHED: the final model is logged; the only state a gate judges
    FAILED = "failed"  # FAILED: could not finish; a retry resumes it
    STOPPED = "stopped"  # KILLED by the operator's `stop` after a final checkpoint; `train` again continues it
    PREEMPTED = "preempted"  # KILLED by a SIGTERM to the master (eviction, drain); a retry continues it

    @property
    def mlflow_status(self) -> str:
        return {"succeeded": "FINISHED", "failed": "FAILED", "stopped": "KILLED", "preempted": "KILLED",
                "running": "RUNNING"}[self.value]


def run_outcome(run) -> str:
    """How an MLflow run of a job ended: its state tag, else (a run of an older release) its status."""
    tagged = run.data.tags.get(STATE_TAG)
    if tagged in {o.value for o in RunOutcome} and (tagged != RunOutcome.RUNNING or run.info.status == "RUNNING"):
        return tagged
    return {"FINISHED": "succeeded", "FAILED": "failed", "KILLED": "stopped"}.get(run.info.status, run.info.status.lower())


# The parameters a checkpoint's ledger and state only make sense with: resuming with any other
# value would apply rows of different data, cut differently, to a different model.
RESUME_MUST_MATCH = {
    "data_content_hash": ("data content hash", "pass the data the run was trained on"),
    "model_def": ("model definition", "pass the run's --model-def"),
    "model_def_sha256": ("model definition's source", "restore the model definition the run was trained with"),
    "rows_per_task": ("task size (rows per task = minibatch size x minibatches per task)",
                      "pass the run's --minibatch-size and --minibatches-per-task"),
}


class TrackingError(ElasticStepError):
    """MLflow cannot be used (unreachable at start, no such run or model)."""


@contextlib.contextmanager
def tracking_errors(what: str):
    """An error MLflow raises inside becomes one TrackingError line, without the tracking URI's
    password (MLflow puts the whole URI into its messages)."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as exc:
        raise TrackingError(redact(f"{what}: MLflow failed: {' '.join(str(exc).split())[:400]}")) from None


def default_tracking_uri(job_dir: str) -> str:
    return f"sqlite:///{os.path.join(os.path.abspath(job_dir), 'mlflow.db')}"


def pipeline_run_id(given: str = "") -> str:
    """The pipeline run this step belongs to, when a pipeline runs it: as the pipeline passed
    it (KFP's PIPELINE_JOB_ID placeholder), else from the runner's environment (KFP, Argo)."""
    return given or os.environ.get("KFP_RUN_ID") or os.environ.get("ARGO_WORKFLOW_NAME") or ""


def connect(uri: str, job_dir: str):
    """An MlflowClient for `uri`, checked to answer before anything else starts."""
    from mlflow.tracking import MlflowClient

    if uri.startswith("sqlite:///"):
        # Create the schema once, from this process, before workers or threads touch it:
        # several processes creating a fresh SQLite database at once corrupt it.
        os.makedirs(os.path.dirname(uri[len("sqlite:///"):]) or ".", exist_ok=True)
        seed_database(uri[len("sqlite:///"):])  # a fresh one from MLflow's schema, copied: seconds sooner
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    if redact(uri) != uri:
        # MLflow prints links to runs built from the tracking URI, password and all.
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    use_tracking_uri(uri)
    client = MlflowClient(uri)
    try:
        client.search_experiments(max_results=1)
    except Exception as exc:
        raise TrackingError(redact(
            f"MLflow at {uri} is not reachable ({type(exc).__name__}: {str(exc)[:200]}); "
            "start it, or pass --mlflow-uri / MLFLOW_TRACKING_URI pointing at a running server"
        )) from None
    return client


def job_key(job_name: str, pipeline_run: str) -> str:
    return hashlib.sha256(json.dumps([job_name, pipeline_run]).encode("utf-8")).hexdigest()[:32]


def resume_mismatch(run_id: str, job_name: str, recorded: dict, current: dict) -> str | None:
    """One line saying what differs between a run's recorded parameters and this job's, among
    those a resume depends on, and what to do (None when nothing does). A parameter the run never
    recorded is not compared."""
    differences, hints = [], []
    for key, (what, hint) in RESUME_MUST_MATCH.items():
        if key in recorded and key in current and str(recorded[key]) != str(current[key])[:6000]:
            differences.append(f"{what}: the run has {recorded[key]!r}, this job {current[key]!r}")
            hints.append(hint)
    if not differences:
        return None
    return (f"cannot resume run {run_id} of job {job_name!r}: " + "; ".join(differences)
            + f". To continue it, {'; '.join(hints)}; to train afresh, use another --job-name or drop --resume")


class RunTracker:
    def __init__(self, client, experiment: str, job_name: str, artifact_root: str | None = None, pipeline_run: str = "",
                 experiment_id: str | None = None):
        """`experiment_id`: the experiment a pipeline runner chose (KFP's MLflow integration: its
        task run's), which `experiment`, the name, then does not override."""
        self.client = client
        self.job_name = job_name
        # A retried pipeline task finds its earlier run by its job and this pipeline run.
        self.pipeline_run = pipeline_run_id(pipeline_run)
        self.uploader = Uploader()
        found = client.get_experiment(experiment_id) if experiment_id else client.get_experiment_by_name(experiment)
        if found is None:
            self.experiment_id = client.create_experiment(experiment, artifact_location=artifact_root)
        else:
            self.experiment_id = found.experiment_id
        self.run_id = ""
        self._metrics: list = []
        self._last_flush = time.monotonic()

    # -- the run -------------------------------------------------------------------------------
    def find_run(self) -> str | None:
        """The newest unfinished run of this job (and of this pipeline run, when there is one):
        a finished run has nothing left to resume. Found by a digest tag, then matched exactly."""
        pipeline_run = self.pipeline_run
        query = f"tags.`{JOB_KEY_TAG}` = '{job_key(self.job_name, pipeline_run)}' and attributes.status != 'FINISHED'"
        runs = self.client.search_runs([self.experiment_id], query, order_by=["attributes.start_time DESC"], max_results=50)
        for run in runs:
            tags = run.data.tags
            if tags.get(JOB_TAG) == self.job_name and tags.get(PIPELINE_RUN_TAG, "") == pipeline_run:
                return run.info.run_id
        return None

    def continued_run(self, run_id: str | None) -> str | None:
        """`run_id` (the run an earlier attempt in this job folder recorded) when it is still this
        job's and unfinished: what a plain retry of the same command continues."""
        from mlflow.exceptions import MlflowException

        if not run_id:
            return None
        try:
            run = self.client.get_run(run_id)
        except MlflowException:
            return None  # deleted, or another store's
        tags = run.data.tags
        ours = (run.info.experiment_id == self.experiment_id and tags.get(JOB_TAG) == self.job_name
                and tags.get(PIPELINE_RUN_TAG, "") == self.pipeline_run and run.info.lifecycle_stage == "active")
        return run_id if ours and run.info.status != "FINISHED" else None

    def start(self, resume: bool, parent_run_id: str | None = None, params: dict | None = None,
              previous: str | None = None) -> bool:
        """Start (or reopen) the job's run. True when an earlier run was reopened: with `resume` or
        in a pipeline run, the job's newest unfinished run; otherwise `previous`, the run of an
        earlier attempt in the same job folder, when it is unfinished. Reopening compares `params`
        with the run's own first: a mismatch in what a resume depends on is a ConfigError where
        the resume was asked for (or is a pipeline's retry), and otherwise starts a new run,
        saying why; either way the earlier run is left as it was."""
        insist = resume or bool(self.pipeline_run)
        existing = self.find_run() if insist else self.continued_run(previous)
        if existing and params is not None:
            mismatch = resume_mismatch(existing, self.job_name, self.client.get_run(existing).data.params, params)
            if mismatch and insist:
                raise ConfigError(mismatch)
            if mismatch:
                log.warning("not continuing the unfinished run %s of this job folder (%s); starting a new run",
                            existing, mismatch.split(": ", 1)[1].split(". To continue")[0])
                existing = None
        if existing:
            self.run_id = existing
            self.client.update_run(existing, status="RUNNING")
            self.client.set_tag(existing, STATE_TAG, RunOutcome.RUNNING)
            return True
        tags = {JOB_TAG: self.job_name, "mlflow.runName": self.job_name,
                JOB_KEY_TAG: job_key(self.job_name, self.pipeline_run), STATE_TAG: RunOutcome.RUNNING}
        if self.pipeline_run:
            tags[PIPELINE_RUN_TAG] = self.pipeline_run
        if parent_run_id:
            tags["mlflow.parentRunId"] = parent_run_id
        self.run_id = self.client.create_run(self.experiment_id, tags=tags).info.run_id
        return False

    def finish(self, ok: bool = False, timeout_s: float = 600.0, outcome: RunOutcome | None = None) -> bool:
        """Mark the run ended (as `outcome`; without one, succeeded when `ok`, else failed) once
        everything queued has reached MLflow. A run whose records did not all arrive is FAILED (it
        can still be resumed), never left RUNNING; MLflow may be away still, so these calls are
        tried directly, once. True when all arrived."""
        outcome = outcome or (RunOutcome.SUCCEEDED if ok else RunOutcome.FAILED)
        self.flush_metrics()
        drained = self.uploader.drain(timeout_s)
        if not drained and outcome == RunOutcome.SUCCEEDED:
            outcome = RunOutcome.FAILED
        try:
            self.client.set_tag(self.run_id, STATE_TAG, outcome)
            self.client.set_terminated(self.run_id, outcome.mlflow_status if drained else "FAILED")
        except Exception as exc:
            log.error("could not mark MLflow run %s %s: %s", self.run_id, outcome, redact(str(exc)[:300]))
            return False
        return drained

    # -- what is recorded -----------------------------------------------------------------------
    def log_params(self, params: dict) -> None:
        from mlflow.entities import Param

        items = [Param(k, redact(str(v))[:6000]) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):
            batch = items[i:i + 100]
            self.uploader.submit("log params", lambda b=batch: self.client.log_batch(self.run_id, params=b))

    def log_metric(self, key: str, value: float, step: int, timestamp: float | None = None) -> None:
        from mlflow.entities import Metric

        self._metrics.append(Metric(key, float(value), int((timestamp or time.time()) * 1000), int(step)))
        if len(self._metrics) >= 900 or time.monotonic() - self._last_flush > 2.0:
            self.flush_metrics()

    def flush_metrics(self) -> None:
        batch, self._metrics = self._metrics, []
        self._last_flush = time.monotonic()
        if batch:
            self.uploader.submit("log metrics", lambda: self.client.log_batch(self.run_id, metrics=batch))

    def set_tag(self, key: str, value: str) -> None:
        self.uploader.submit(f"tag {key}", lambda: self.client.set_tag(self.run_id, key, value))

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        self.uploader.submit(f"artifact {path}", lambda: self.client.log_artifact(self.run_id, path, artifact_path))

    def log_artifacts(self, folder: str, artifact_path: str) -> None:
        self.uploader.submit(f"artifacts {folder}", lambda: self.client.log_artifacts(self.run_id, folder, artifact_path))
