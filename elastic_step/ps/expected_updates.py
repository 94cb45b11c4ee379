"""How many times a clean run updates each embedding row: the ground truth that a PS job's
per-row update counters are checked against, whatever was killed during the run.

A task is rows [k*B, (k+1)*B) of one data shard (B: the minibatch), and each minibatch pushes one
merged update per distinct id, so each row's count follows from the data alone, whoever trained it.
"""

from __future__ import annotations

from collections import Counter

import numpy as np


def expected_updates(data: str, model_definition: str, minibatch: int, epochs: int = 1) -> Counter:
    """Per id (the model definition's ids, as its `feed` makes them from the prepared data at
    `data`), the updates a clean run of `epochs` over the train split applies."""
    from elastic_step.data.manifest import load_manifest
    from elastic_step.data.reader import ShardReader
    from elastic_step.frameworks.model_def import batch_arrays, load_model_definition

    manifest = load_manifest(data)
    model_def, reader = load_model_definition(model_definition), ShardReader(manifest)
    fields = len(model_def.module.SPARSE.columns)
    counts = Counter()
    for index, shard in enumerate(manifest.splits["train"]):
        features, _ = batch_arrays(model_def, reader.read("train", index, 0, shard.rows), manifest.features, manifest.label)
        ids = features[:, :fields].astype(np.int64)
        for start in range(0, shard.rows, minibatch):
            counts.update(np.unique(ids[start:start + minibatch]).tolist())
    return Counter({i: n * epochs for i, n in counts.items()})
