"""What the release steps know about a trained model: its training run, its logged model, its
model definition (a parameter of the run) and the rows it is judged on."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from elastic_step.data.manifest import load_manifest, validate_shards
from elastic_step.data.reader import ShardReader
from elastic_step.errors import DataError
from elastic_step.frameworks.model_def import ModelDefinition, batch_arrays, load_model_definition
from elastic_step.tracking.run import TrackingError


@dataclass
class Candidate:
    run_id: str
    model_uri: str
    model_def_source: str
    params: dict
    metrics: dict
    experiment_id: str


def load_candidate(client, run_id: str, model_uri: str) -> Candidate:
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise TrackingError(f"training run {run_id!r} does not exist on {client.tracking_uri}; "
                            "pass the run id the training step wrote") from None
    model_def = run.data.params.get("model_def")
    if not model_def:
        raise TrackingError(f"run {run_id} has no model_def parameter: it was not made by elastic-step train")
    return Candidate(run_id, model_uri or run.data.tags.get("elastic_step.model_uri", ""), model_def,
                     dict(run.data.params), dict(run.data.metrics), run.info.experiment_id)


def split_arrays(data: str, model_def: ModelDefinition, split: str = "test") -> tuple[np.ndarray, np.ndarray]:
    """The features and labels of a split, as the model definition feeds them."""
    manifest = load_manifest(data)
    if manifest.rows(split) == 0:
        raise DataError(f"the {split} split of {manifest.root} is empty; prepare the data with a non-zero "
                        f"{split} fraction (e.g. --split 0.8,0.1,0.1)")
    validate_shards(manifest, [split])
    batch = ShardReader(manifest).read_split(split)
    return batch_arrays(model_def, batch, manifest.features, manifest.label)


def candidate_rows(candidate: Candidate, data: str, split: str = "test"):
    return split_arrays(data, load_model_definition(candidate.model_def_source), split)


def predict(model_uri: str, features: np.ndarray) -> np.ndarray:
    """Outputs of any logged or registered MLflow model through its pyfunc flavour, so that
    PyTorch, TorchScript and Keras models are judged by one code path."""
    import mlflow.pyfunc

    try:
        model = mlflow.pyfunc.load_model(model_uri)
    except Exception as exc:
        raise TrackingError(f"model {model_uri!r} cannot be loaded: {type(exc).__name__}: {str(exc)[:300]}") from None
    return np.asarray(model.predict(features))
