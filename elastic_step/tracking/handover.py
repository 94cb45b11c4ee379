"""What a pipeline runner hands a step about MLflow, and what a step may do with it.

KFP's MLflow integration (kubeflow/pipelines, proposal 12862): the API server opens a parent run
per pipeline run, and the driver a nested run per task; it sets on the task's container
MLFLOW_TRACKING_URI, MLFLOW_WORKSPACE, MLFLOW_EXPERIMENT_ID and MLFLOW_RUN_ID (the task's own
nested run, which KFP's launcher marks finished or failed once the step exits), and the
credentials (MLFLOW_TRACKING_USERNAME/PASSWORD or MLFLOW_TRACKING_TOKEN) from a Secret by
reference. MLflow's client reads the workspace and the credentials itself. A step's own runs (the
training run, the gate's evaluation) are created as children of that task run, in its experiment,
so the pipeline run's tree in MLflow holds them instead of a duplicate tree beside it.

A step of a pipeline (KFP or Argo) has no default tracking URI: the local default, a SQLite file
in the job folder, would be inside the step's pod and gone with it, and the next step would find
nothing. And where the step's environment holds MLflow credentials, the URI is the one that came
with them (from the same Secret, or fixed when the pipeline was rendered): a URI given as a
parameter, which whoever submits a run controls, could otherwise receive the password.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from elastic_step.errors import ConfigError

CREDENTIAL_ENV = ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
URI_ENV = "MLFLOW_TRACKING_URI"


class Runner(StrEnum):
    """The pipeline runner a step runs under."""

    KFP = "KFP"
    ARGO = "Argo"


def pipeline_runner(env: Mapping[str, str] | None = None) -> Runner | None:
    """KFP's driver puts KFP_POD_NAME on every task's container; Argo's controller puts
    ARGO_CONTAINER_NAME on every container of a workflow pod (and the shipped templates set
    ARGO_WORKFLOW_NAME). None: not a pipeline step (a local `train`, kfp.local, a test)."""
    env = os.environ if env is None else env
    if env.get("KFP_POD_NAME"):
        return Runner.KFP
    if env.get("ARGO_CONTAINER_NAME") or env.get("ARGO_WORKFLOW_NAME"):
        return Runner.ARGO
    return None


@dataclass(frozen=True)
class TaskRun:
    """The nested run KFP's driver opened for this task."""

    run_id: str
    experiment_id: str
    tracking_uri: str


def kfp_task_run(tracking_uri: str, env: Mapping[str, str] | None = None) -> TaskRun | None:
    """The task run KFP handed over, when there is one on the server this step tracks to (a run
    on another server cannot be a parent)."""
    env = os.environ if env is None else env
    run_id, experiment_id, uri = (env.get(k, "").strip() for k in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID", URI_ENV))
    if not (run_id and experiment_id and uri) or uri.rstrip("/") != tracking_uri.rstrip("/"):
        return None
    return TaskRun(run_id, experiment_id, uri)


def take_task_run(tracking_uri: str) -> TaskRun | None:
    """The handed-over task run, and MLFLOW_RUN_ID out of this process's environment: MLflow's
    `start_run()` without a run id would otherwise reopen KFP's run and log the step's records
    (and a parent tag) into it. The step's own runs are made its children instead."""
    task = kfp_task_run(tracking_uri)
    if task is not None:
        os.environ.pop("MLFLOW_RUN_ID", None)
    return task


def step_tracking_uri(given: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """The tracking URI to use: `given`, else MLFLOW_TRACKING_URI; None where neither is set and
    the caller may use its local default. In a pipeline step, no URI at all is a ConfigError, and
    so is a `given` URI other than the one that came with the credentials in the environment."""
    env = os.environ if env is None else env
    runner = pipeline_runner(env)
    from_env = env.get(URI_ENV, "").strip()
    uri = (given or "").strip() or from_env
    if runner is None:
        return uri or None
    if not uri:
        raise ConfigError(
            f"no MLflow tracking URI in this {runner} step: its run would go to a SQLite file inside the step's pod "
            f"and be lost with it; set {URI_ENV} from the MLflow Secret (key `uri`), or pass mlflow_uri")
    if any(env.get(k) for k in CREDENTIAL_ENV) and uri.rstrip("/") != from_env.rstrip("/"):
        raise ConfigError(
            f"mlflow_uri is not the {URI_ENV} that came with this step's MLflow credentials: the password goes only "
            f"to the server of its own Secret (key `uri`); leave mlflow_uri empty")
    return uri
