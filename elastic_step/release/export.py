"""Export: the candidate in its serving format (TorchScript for PyTorch, SavedModel for Keras),
with signature and input example, registered as a new version of the named model and tagged
with what a person auditing the registry asks first: how good, on which data, from which run."""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass

from elastic_step.frameworks.model_def import load_model_definition
from elastic_step.frameworks.registry import build_trainer
from elastic_step.frameworks.weights import serves_from_snapshots
from elastic_step.ps.embedding import TABLES_FILE, hold_tables, read_tables, trainer_network
from elastic_step.release.candidate import load_candidate, split_head, split_manifest
from elastic_step.errors import ConfigError
from elastic_step.release.registry import model_exists, name_filter, registry_client
from elastic_step.tracking.checkpoints import BEST_TAG, CheckpointStore, checkpoint_name
from elastic_step.tracking.recorder import FINAL_MODEL_ARTIFACTS
from elastic_step.tracking.run import TrackingError, pipeline_run_id
from elastic_step.tracking.uri import use_tracking_uri

log = logging.getLogger("elastic_step.release")

SOURCE_RUN_TAG = "elastic_step.source_run_id"
CHECKPOINT_TAG = "elastic_step.source_checkpoint"  # "final", or "best step-SSSSSS" (a version from before: final)
CHECKPOINTS = ("final", "best")


@dataclass
class Export:
    name: str
    version: str
    registered_model_uri: str  # models:/NAME/VERSION
    serving_model_uri: str
    reused: bool  # a retried export found the version it had already registered


def export_model(*, run_id: str, model_uri: str, data: str, registered_model: str, mlflow_uri: str | None = None,
                 pipeline_run: str = "", model_def: str | None = None, checkpoint: str = "final") -> Export:
    """`model_def`: the pipeline's model definition, whose network the run's weights file is
    loaded into (no MLflow model is unpickled). `checkpoint`: `final` (the finished job's model)
    or `best` (the best validated checkpoint the run kept with `train --keep-best`)."""
    import mlflow

    if checkpoint not in CHECKPOINTS:
        raise ConfigError(f"--checkpoint {checkpoint!r} is not one of {', '.join(CHECKPOINTS)}")
    name_filter(registered_model)  # a name MLflow's search cannot express is refused before anything else
    client = registry_client(mlflow_uri)
    candidate = load_candidate(client, run_id, model_uri, model_def)
    # The run's records alone decide these refusals: before the model definition is imported
    # (a framework's import costs seconds and may write its own lines to stderr).
    _refuse_unexportable(client, candidate, run_id, checkpoint)
    model_def = load_model_definition(candidate.model_def_source)
    split_manifest(data, "test")  # first: the model may be sized by its specs (SparseFeatures.num_ids)
    trainer = build_trainer(model_def)
    best = None
    if checkpoint == "best":  # read first: its step is part of what was exported
        best = _best_checkpoint(client, run_id)
        source = f"best {checkpoint_name(best.step)}"
    else:
        source = "final"
    existing = _version_of_run(client, registered_model, run_id, source)
    if existing is not None:  # a retried step: never register the same weights of a run twice
        return Export(registered_model, str(existing.version), f"models:/{registered_model}/{existing.version}", existing.source, True)

    if best is not None:
        _load_best(trainer, best, source, run_id, candidate.model_def_source)
    else:
        _load_final(trainer, client, run_id)
    info = _log_serving_model(trainer, model_def, data, client, run_id)
    tags = _version_tags(client, candidate, trainer, run_id, pipeline_run, source, best)
    version = mlflow.register_model(info.model_uri, registered_model, tags=tags, await_registration_for=60)
    log.info("registered %s version %s from run %s", registered_model, version.version, run_id)
    return Export(registered_model, str(version.version), f"models:/{registered_model}/{version.version}", info.model_uri, False)


def _refuse_unexportable(client, candidate, run_id: str, checkpoint: str) -> None:
    """What a --mode ps run cannot export: its best checkpoint (only its final tables are logged
    with the model), or tables too large for an exported model to hold (_check_tables_held)."""
    if checkpoint == "best" and candidate.params.get("mode") == "ps":
        raise ConfigError(f"--checkpoint best: run {run_id} trained its embedding tables on parameter-server shards, and "
                          "only its final tables are logged with the model; export its final model (--checkpoint final)")
    if candidate.params.get("mode") == "ps":
        _check_tables_held(client, candidate)


def _load_best(trainer, best, source: str, run_id: str, model_def_source: str) -> None:
    """The best checkpoint's weights into the trainer's network."""
    try:
        trainer.load_model_bytes(trainer.model_bytes_of_state(best.state))  # weights_only: nothing unpickled
    except Exception as exc:
        raise TrackingError(f"the best checkpoint ({source}) of run {run_id} does not fit the network of "
                            f"{model_def_source!r}: {type(exc).__name__}: {str(exc)[:300]}; give the model "
                            "definition the run was trained with") from None


def _load_final(trainer, client, run_id: str) -> None:
    """The finished job's model file into the trainer's network, with a --mode ps model's tables."""
    import mlflow

    with tempfile.TemporaryDirectory() as tmp:
        try:
            folder = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=FINAL_MODEL_ARTIFACTS, dst_path=tmp,
                                                         tracking_uri=client.tracking_uri)
        except Exception as exc:
            raise TrackingError(f"run {run_id} has no final model under {FINAL_MODEL_ARTIFACTS}/ "
                                f"({type(exc).__name__}); export a run that `elastic-step train` finished") from None
        with open(os.path.join(folder, "model.bin"), "rb") as f:
            trainer.load_model_bytes(f.read())
        tables = os.path.join(folder, TABLES_FILE)  # a --mode ps model's trained tables: exported with it
        if os.path.exists(tables):
            try:
                hold_tables(trainer_network(trainer), read_tables(tables))
            except ValueError as exc:
                raise TrackingError(f"run {run_id}: {exc}") from None


def _log_serving_model(trainer, model_def, data: str, client, run_id: str):
    """The model in its serving format, with its signature and an input example of the test
    split, logged to the training run: its model info."""
    import mlflow
    from mlflow.models import infer_signature

    example = split_head(data, model_def, rows=5)
    signature = infer_signature(example, trainer.predict(example))
    use_tracking_uri(client.tracking_uri)
    with mlflow.start_run(run_id=run_id):
        return trainer.log_serving_model(example, signature)


def _version_tags(client, candidate, trainer, run_id: str, pipeline_run: str, source: str, best) -> dict:
    """The registered version's tags: which run and weights it came from, on which data, and how good."""
    tags = {SOURCE_RUN_TAG: run_id, "framework": trainer.framework,
            "data_content_hash": candidate.params.get("data_content_hash", ""),
            "pipeline_run_id": pipeline_run or pipeline_run_id(), "model_def": candidate.model_def_source,
            CHECKPOINT_TAG: source}
    if best is None:  # the run's test metrics are the final model's
        tags.update({name: f"{value:.6g}" for name, value in candidate.metrics.items() if name.startswith("test_")})
    else:  # "STEP METRIC VALUE": the validation metric it was chosen by
        tags[BEST_TAG] = client.get_run(run_id).data.tags.get(BEST_TAG, "")
    return tags


def _check_tables_held(client, candidate) -> None:
    """A --mode ps run whose tables exceeded --ps-table-limit-mb logged them as its shards'
    snapshots, which a TorchScript or SavedModel cannot hold: its pyfunc model is what serves it."""
    if serves_from_snapshots(client, candidate.run_id):
        raise ConfigError(f"run {candidate.run_id}: its embedding tables exceeded train --ps-table-limit-mb and are served "
                          f"from its shards' snapshots, which an exported model cannot hold; serve its MLflow pyfunc model "
                          f"{candidate.model_uri} instead (mlflow models serve -m {candidate.model_uri} --env-manager local)")


def _best_checkpoint(client, run_id: str):
    """The best checkpoint a run kept (its state file is parsed with weights_only by the trainer)."""
    from types import SimpleNamespace

    with tempfile.TemporaryDirectory() as tmp:
        return CheckpointStore(SimpleNamespace(client=client, run_id=run_id), tmp).best_checkpoint(run_id)


def _version_of_run(client, name: str, run_id: str, source: str = "final"):
    """The version already registered from these weights of the run (`source`: final, or the best
    checkpoint's step), if any."""
    from mlflow.exceptions import MlflowException

    try:
        # By name alone, the run's tag matched here: some registries (Unity Catalog) refuse a tag in the filter.
        versions = client.search_model_versions(name_filter(name))
    except MlflowException:
        if not model_exists(client, name):  # nothing registered under the name yet (basic auth refuses, not 404s)
            return None
        raise  # any other failure: registering again would make a second version of the same weights
    versions = [v for v in versions
                if v.tags.get(SOURCE_RUN_TAG) == run_id and v.tags.get(CHECKPOINT_TAG, "final") == source]
    return versions[0] if versions else None
