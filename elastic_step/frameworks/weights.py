"""A trained model's weights from MLflow without unpickling anything.

Every run `elastic-step train` finishes logs its final parameters as a plain weights file
(`elastic_step_model/model.bin`: a PyTorch state dict for `torch.load(weights_only=True)`, or a
Keras `.npz` read with `allow_pickle=False`), beside the MLflow model of its flavour. Warm start
and the evaluation gate read that file and build the network from a model definition they were
given; they never load an MLflow model through its flavour (`mlflow.pytorch.load_model` is a
pickle, a Keras model file may carry code), so whoever can write to MLflow can change weights
but cannot run code in the pipeline's pods.

A `--mode ps` run logs its trained embedding tables beside it (`elastic_step_model/ps_tables.npz`,
numpy arrays read with `allow_pickle=False`): the gate and export give them to the network they
build (ps/embedding.py's hold_tables). One whose tables exceeded `train --ps-table-limit-mb` logs
its shards' final snapshots instead, once, with its pyfunc model (`elastic_step_model/ps_shards/`
holds only their manifest, ps/shard_tables.py): the gate's network looks its rows up there
(ps/embedding.py's read_rows_from).

A model URI names its run: `runs:/RUN/...`, `models:/NAME@ALIAS`, `models:/NAME/VERSION` (the
version's source run), or MLflow 3's `models:/m-ID` (the logged model's source run).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass

from elastic_step.errors import ElasticStepError

FINAL_MODEL_ARTIFACTS = "elastic_step_model"  # model.bin + model.json of the finished job (the recorder logs it)
WEIGHTS_FILE = "model.bin"


class WeightsError(ElasticStepError):
    """A model URI whose run, or whose run's weights file, cannot be found."""


def run_of_model_uri(model_uri: str, client) -> str:
    """The training run a model URI comes from."""
    from mlflow.exceptions import MlflowException

    try:
        if model_uri.startswith("runs:/"):
            return model_uri[len("runs:/"):].split("/")[0]
        if not model_uri.startswith("models:/"):
            raise WeightsError(f"model {model_uri!r} is neither runs:/RUN/PATH nor models:/NAME@ALIAS, models:/NAME/VERSION "
                               "or models:/ID; give the URI the train or export step wrote")
        rest = model_uri[len("models:/"):].strip("/")
        if "@" in rest:
            name, alias = rest.split("@", 1)
            version = client.get_model_version_by_alias(name, alias)
        elif "/" in rest:
            name, number = rest.rsplit("/", 1)
            version = client.get_model_version(name, number)
        else:
            return _logged_model_run(client, rest, model_uri)
        if version.run_id:
            return version.run_id
        if getattr(version, "model_id", None):
            return _logged_model_run(client, version.model_id, model_uri)
    except MlflowException as exc:
        raise WeightsError(f"model {model_uri!r} cannot be found: {exc.message[:300]}") from None
    raise WeightsError(f"model {model_uri!r} was not registered from a training run, so it has no weights file; "
                       "register the version the export step made")


def _logged_model_run(client, model_id: str, model_uri: str) -> str:
    run_id = client.get_logged_model(model_id).source_run_id
    if not run_id:
        raise WeightsError(f"model {model_uri!r} was not logged by a training run, so it has no weights file")
    return run_id


@dataclass(frozen=True)
class TrainedRun:
    """The training run a model URI comes from, resolved once: what reads several of its files
    (the evaluation gate: weights, then tables or shards) asks MLflow once for the run and once
    for the final model's listing."""

    model_uri: str
    client: object
    run_id: str
    final_files: frozenset  # the paths logged under FINAL_MODEL_ARTIFACTS

    @classmethod
    def of(cls, model_uri: str, tracking_uri: str | None = None) -> TrainedRun:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri)
        run_id = run_of_model_uri(model_uri, client)
        try:  # a runs:/ URI names its run without asking MLflow: here is where a missing one shows
            listed = client.list_artifacts(run_id, FINAL_MODEL_ARTIFACTS)
        except Exception as exc:
            raise _no_weights(run_id, model_uri, exc) from None
        return cls(model_uri, client, run_id, frozenset(a.path for a in listed))


def final_model_bytes(model_uri: str, tracking_uri: str | None = None, run: TrainedRun | None = None) -> bytes:
    """The weights file of the run a model URI comes from (raw bytes; the framework parses them
    without pickle). `run`: that run, already resolved."""
    import mlflow
    from mlflow.tracking import MlflowClient

    if run is not None:
        client, run_id = run.client, run.run_id
    else:
        client = MlflowClient(tracking_uri)
        run_id = run_of_model_uri(model_uri, client)
    with tempfile.TemporaryDirectory() as tmp:
        try:  # the file alone: not a --mode ps model's tables beside it
            path = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=f"{FINAL_MODEL_ARTIFACTS}/{WEIGHTS_FILE}",
                                                       dst_path=tmp, tracking_uri=client.tracking_uri)
            with open(path, "rb") as f:
                return f.read()
        except Exception as exc:
            raise _no_weights(run_id, model_uri, exc) from None


def _no_weights(run_id: str, model_uri: str, exc: Exception) -> WeightsError:
    return WeightsError(f"run {run_id} of model {model_uri!r} has no weights file {FINAL_MODEL_ARTIFACTS}/{WEIGHTS_FILE} "
                        f"({type(exc).__name__}); use a model that `elastic-step train` finished")


def final_model_tables(model_uri: str, tracking_uri: str | None = None, run: TrainedRun | None = None) -> dict:
    """The trained embedding tables of a `--mode ps` run a model URI comes from (its
    `elastic_step_model/ps_tables.npz`, read with allow_pickle=False), by table name; {} for a
    run whose model has none. `run`: that run, already resolved."""
    import mlflow

    from elastic_step.ps.embedding import TABLES_FILE, read_tables

    run = run or TrainedRun.of(model_uri, tracking_uri)
    client, run_id = run.client, run.run_id
    path = f"{FINAL_MODEL_ARTIFACTS}/{TABLES_FILE}"
    if path not in run.final_files:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        local = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=path, dst_path=tmp,
                                                    tracking_uri=client.tracking_uri)
        try:
            return read_tables(local)
        except ValueError as exc:
            raise WeightsError(f"run {run_id} of model {model_uri!r}: {exc}") from None


def serves_from_snapshots(client, run_id: str) -> bool:
    """Whether a --mode ps run's tables exceeded --ps-table-limit-mb, so that its model serves
    them from the shards' snapshots: beside its weights file it logged their manifest."""
    return _holds_shards({a.path for a in client.list_artifacts(run_id, FINAL_MODEL_ARTIFACTS)})


def _holds_shards(final_files) -> bool:
    from elastic_step.ps.shard_tables import SHARDS_FOLDER

    return f"{FINAL_MODEL_ARTIFACTS}/{SHARDS_FOLDER}" in final_files


def _pyfunc_shards(client, run_id: str) -> str:
    """Where the run's sharded pyfunc model keeps the shards' snapshots (its `shards` artifact, as
    its MLmodel file names it): they are logged there only, beside the weights only their
    manifest (tracking/recorder.py)."""
    import mlflow
    import yaml

    logged = client.get_run(run_id).data.tags.get("elastic_step.model_uri", "")
    if not logged.startswith("models:/m-"):
        raise WeightsError(f"run {run_id} logged its shards' snapshots with a model, but names no logged model "
                           f"(tag elastic_step.model_uri {logged!r}); give a run that `elastic-step train` finished")
    location = client.get_logged_model(logged[len("models:/"):]).artifact_location.rstrip("/")
    with tempfile.TemporaryDirectory() as tmp:
        described = mlflow.artifacts.download_artifacts(artifact_uri=f"{location}/MLmodel", dst_path=tmp)
        with open(described, encoding="utf-8") as f:
            artifacts = (yaml.safe_load(f).get("flavors", {}).get("python_function", {}).get("artifacts") or {})
    path = (artifacts.get("shards") or {}).get("path")
    if not path:
        raise WeightsError(f"the model of run {run_id} ({logged}) holds no shards' snapshots; give a run that "
                           "`elastic-step train --mode ps` finished")
    return f"{location}/{path}"


def final_model_shards(model_uri: str, tracking_uri: str | None = None, run: TrainedRun | None = None):
    """The shards' tables (ps/shard_tables.ShardTables) of a `--mode ps` run whose tables were too
    big to hold whole (its `elastic_step_model/ps_shards/` holds their manifest; the snapshots,
    from its pyfunc model); None for any other run. `run`: that run, already resolved."""
    import mlflow

    from elastic_step.ps.shard_tables import ShardTables

    run = run or TrainedRun.of(model_uri, tracking_uri)
    client, run_id = run.client, run.run_id
    if not _holds_shards(run.final_files):
        return None
    # The snapshots are memory-mapped: the maps stay readable once the folder is removed (POSIX).
    with tempfile.TemporaryDirectory() as tmp:
        local = mlflow.artifacts.download_artifacts(artifact_uri=_pyfunc_shards(client, run_id), dst_path=tmp,
                                                    tracking_uri=client.tracking_uri)
        try:
            return ShardTables.open(local)
        except ValueError as exc:
            raise WeightsError(f"run {run_id} of model {model_uri!r}: {exc}") from None
