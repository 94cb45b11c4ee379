"""Evaluating a trained model on a split of the prepared data."""

from __future__ import annotations

import numpy as np

from elastic_step.data.manifest import Manifest
from elastic_step.data.reader import ShardReader
from elastic_step.frameworks.api import Trainer
from elastic_step.frameworks.model_def import ModelDefinition, batch_arrays


def evaluate(trainer: Trainer, model_def: ModelDefinition, manifest: Manifest, split: str = "test") -> dict[str, float]:
    """Loss, accuracy (for class-index labels and one output per class) and the model
    definition's own metrics()."""
    if manifest.rows(split) == 0:
        return {}
    batch = ShardReader(manifest).read_split(split)
    features, labels = batch_arrays(model_def, batch, manifest.features, manifest.label)
    outputs = trainer.predict(features)
    results = {"loss": trainer.loss_value(outputs, labels), "rows": float(len(labels))}
    if outputs.ndim == 2 and outputs.shape[1] > 1 and np.issubdtype(labels.dtype, np.integer):
        results["accuracy"] = float((outputs.argmax(axis=1) == labels).mean())
    if model_def.metrics is not None:
        for name, fn in model_def.metrics().items():
            results[name] = float(fn(outputs, labels))
    return results
