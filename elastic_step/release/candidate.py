"""What the release steps know about a trained model: its training run, its logged model, the
model definition to rebuild it from (the pipeline's own parameter; a run's `model_def` parameter
only where none is given) and the rows it is judged on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from elastic_step.data.manifest import load_manifest, validate_shards
from elastic_step.data.reader import ShardReader
from elastic_step.errors import ConfigError, DataError
from elastic_step.frameworks.model_def import ModelDefinition, batch_arrays
from elastic_step.tracking.run import TrackingError
from elastic_step.tracking.uri import redact


@dataclass
class Candidate:
    run_id: str
    model_uri: str
    model_def_source: str
    params: dict
    metrics: dict
    experiment_id: str


def load_candidate(client, run_id: str, model_uri: str, model_def: str | None = None) -> Candidate:
    """`model_def`: the pipeline's model definition parameter. Without it (None) the run's
    `model_def` parameter is used, which whoever can write to MLflow can change: the CLI steps,
    the components and the pipelines always pass it; an empty one is an error, never a fallback."""
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise TrackingError(f"training run {run_id!r} does not exist on {redact(client.tracking_uri)}; "
                            "pass the run id the training step wrote") from None
    if model_def is not None and not model_def.strip():
        # An empty pipeline parameter must not fall back to what the run says.
        raise ConfigError("the model definition is empty; give the module or .py file the run was trained with "
                          "(the pipeline's model-def parameter)")
    model_def = model_def if model_def is not None else run.data.params.get("model_def")
    if not model_def:
        raise TrackingError(f"run {run_id} has no model_def parameter: it was not made by elastic-step train")
    return Candidate(run_id, model_uri or run.data.tags.get("elastic_step.model_uri", ""), model_def,
                     dict(run.data.params), dict(run.data.metrics), run.info.experiment_id)


def split_manifest(data: str, split: str):
    """The dataset's manifest, checked to hold `split`. Loaded before a model is built from its
    definition: one that sizes its tables from the dataset's specs (SparseFeatures.num_ids) reads
    them from the manifest this process loaded last."""
    manifest = load_manifest(data)
    if manifest.rows(split) == 0:
        raise DataError(f"the {split} split of {manifest.root} is empty; prepare the data with a non-zero "
                        f"{split} fraction (e.g. --split 0.8,0.1,0.1)")
    validate_shards(manifest, [split])
    return manifest


def split_batches(data: str, model_def: ModelDefinition, split: str = "test") -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The features and labels of a split, one shard at a time, as the model definition feeds
    them: memory holds one shard, however large the split."""
    manifest = split_manifest(data, split)
    reader = ShardReader(manifest)
    try:
        for index, shard in enumerate(manifest.splits[split]):
            batch = reader.read(split, index, 0, shard.rows)
            yield batch_arrays(model_def, batch, manifest.features, manifest.label)
    finally:
        reader.close()


def split_head(data: str, model_def: ModelDefinition, rows: int, split: str = "test") -> np.ndarray:
    """The features of the first `rows` rows of a split (an input example), reading only the row
    groups that hold them."""
    manifest = split_manifest(data, split)
    reader = ShardReader(manifest)
    try:
        batch = reader.read(split, 0, 0, min(rows, manifest.splits[split][0].rows))
    finally:
        reader.close()
    return batch_arrays(model_def, batch, manifest.features, manifest.label)[0]


def load_weights(model_uri: str, model_def: ModelDefinition, tracking_uri: str | None = None):
    """A trainer of `model_def`'s network holding the weights of the run `model_uri` comes from
    (its weights file, parsed without pickle: frameworks/weights.py). No MLflow model is loaded
    through its flavour, so nothing a writer to MLflow put there is unpickled or imported."""
    from elastic_step.frameworks.registry import build_trainer
    from elastic_step.frameworks.weights import TrainedRun, final_model_bytes, final_model_shards, final_model_tables
    from elastic_step.ps.embedding import hold_tables, read_rows_from, trainer_network

    trainer = build_trainer(model_def)
    run = TrainedRun.of(model_uri, tracking_uri)  # once, for the weights, the tables and the shards
    data = final_model_bytes(model_uri, run=run)
    try:
        trainer.load_model_bytes(data)
    except Exception as exc:
        raise TrackingError(f"the weights of model {model_uri!r} do not fit the network of {model_def.source!r}: "
                            f"{type(exc).__name__}: {str(exc)[:300]}; give the model definition it was trained with") from None
    hold_tables(trainer_network(trainer), final_model_tables(model_uri, run=run))  # a --mode ps model's, this model's only
    shards = final_model_shards(model_uri, run=run)  # ... or its tables served from the shards' snapshots
    if shards is not None:
        read_rows_from(trainer_network(trainer), shards.sources())
    return trainer


def predict_split(model_uris: list[str], data: str, model_def: ModelDefinition, split: str = "test",
                  tracking_uri: str | None = None) -> tuple[list[np.ndarray], np.ndarray]:
    """Every model's outputs on a split, and its labels. Each model is `model_def`'s network with
    the weights its training run logged (never an unpickled MLflow model); the split is read and
    predicted one shard at a time, so only the outputs and labels are held whole."""
    split_manifest(data, split)  # first: the models may be sized by its specs
    models = [load_weights(uri, model_def, tracking_uri) for uri in model_uris]
    outputs: list[list[np.ndarray]] = [[] for _ in models]
    labels = []
    for features, batch_labels in split_batches(data, model_def, split):
        labels.append(batch_labels)
        for model, out in zip(models, outputs):
            out.append(np.asarray(model.predict(features)))
    return [np.concatenate(out) for out in outputs], np.concatenate(labels)
