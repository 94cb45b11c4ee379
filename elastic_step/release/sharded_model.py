"""The MLflow pyfunc model of a `--mode ps` run whose tables were too big to hold whole
(`train --ps-table-limit-mb`): the run's dense weights file and the shards' final snapshots
(ps/shard_tables.py), looked up shard by shard, memory-mapped, at each prediction.

It is logged as MLflow's "model from code" (sharded_model_code.py is the model's code): nothing
of it is pickled, and loading it builds the model definition's network from the weights file
(parsed without pickle, as export does) and reads the snapshots with allow_pickle=False.
`predict` takes a batch of packed feature rows, as the run's other models do, and returns the
network's outputs.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import mlflow.pyfunc
import numpy as np

from elastic_step.data.manifest import MANIFEST_NAME, load_manifest
from elastic_step.data.stores import resolve
from elastic_step.ps.embedding import read_rows_from, trainer_network
from elastic_step.ps.shard_tables import SHARDS_FOLDER, ShardTables

CODE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sharded_model_code.py")


def sharded_trainer(model_def_source: str, weights_file: str, shards_folder: str):
    """A trainer of the model definition's network with the run's dense weights, whose embeddings
    take their rows from the shards' snapshots in `shards_folder`."""
    from elastic_step.frameworks.model_def import load_model_definition
    from elastic_step.frameworks.registry import build_trainer

    trainer = build_trainer(load_model_definition(model_def_source))
    with open(weights_file, "rb") as f:
        trainer.load_model_bytes(f.read())
    read_rows_from(trainer_network(trainer), ShardTables.open(shards_folder).sources())
    return trainer


def save_dataset_specs(manifest, folder: str) -> str:
    """The dataset's manifest and vocabulary files, not its shards: a model definition may size
    its tables from the dataset's specs (SparseFeatures.num_ids), and a serving process has no
    dataset of its own to load them from."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, MANIFEST_NAME), "w", encoding="utf-8") as f:
        json.dump(manifest.to_json(), f)
    for spec in manifest.categorical.values():
        if spec.vocabulary_file:  # a large vocabulary lives beside the manifest
            fs, path, _ = resolve(manifest.root.rstrip("/") + "/" + spec.vocabulary_file)
            target = os.path.join(folder, spec.vocabulary_file)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with fs.open(path, "rb") as source, open(target, "wb") as copy:
                shutil.copyfileobj(source, copy)
    return folder


def _is_file(model_def_source: str) -> bool:
    """A model definition given as a .py file (load_model_definition's rule), not a module name."""
    path = model_def_source.removeprefix("file://")
    return path.endswith(".py") or os.sep in path


class ShardedTablesModel(mlflow.pyfunc.PythonModel):
    def load_context(self, context):
        load_manifest(context.artifacts["dataset"])  # first: the network may be sized by its specs
        # A .py model definition travels with the model; a module name is imported where it is served.
        model_def = context.artifacts.get("model_def", context.model_config["model_def"])
        self.trainer = sharded_trainer(model_def, context.artifacts["weights"], context.artifacts["shards"])

    def predict(self, context, model_input, params=None):
        return self.trainer.predict(np.asarray(model_input))


def log_sharded_model(model_dir: str, model_def_source: str, input_example: np.ndarray, signature, manifest,
                      framework: str):
    """Log the pyfunc model (in the active run) from a job's model folder: its weights file, its
    shards' folder, the dataset's specs (`manifest`'s) and a .py model definition, all copied
    into the model. `framework`: the trainer's (pytorch or tensorflow), for the requirement's extra."""
    from elastic_step import __version__

    extra = "tensorflow" if framework == "tensorflow" else "torch"
    with tempfile.TemporaryDirectory() as tmp:
        artifacts = {"weights": os.path.join(model_dir, "model.bin"), "shards": os.path.join(model_dir, SHARDS_FOLDER),
                     "dataset": save_dataset_specs(manifest, os.path.join(tmp, "dataset"))}
        if _is_file(model_def_source):
            artifacts["model_def"] = os.path.abspath(model_def_source.removeprefix("file://"))
        return mlflow.pyfunc.log_model(
            name="model",
            python_model=CODE_FILE,
            artifacts=artifacts,
            model_config={"model_def": model_def_source},
            signature=signature,
            input_example=input_example,
            pip_requirements=[f"elastic-step[{extra}]=={__version__}", f"numpy=={np.__version__}"],
        )
