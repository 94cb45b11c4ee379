"""How many times a clean run updates each embedding row: the ground truth that a PS job's
per-row update counters are checked against, whatever was killed during the run; and those
counters as a local job's shards left them.

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


def updates_on_the_shards(job_dir: str, table: str) -> Counter:
    """Per id, the updates a local PS job's shards applied to `table`, as their last snapshots
    hold them (JOB_DIR/ps/shard-*/snapshot.bin: each shard writes one as it stops)."""
    import os

    from elastic_step.ps import snapshot

    counts = Counter()
    root = os.path.join(job_dir, "ps")
    for name in sorted(os.listdir(root)):
        tables, _ = snapshot.load(os.path.join(root, name, "snapshot.bin"), [table])
        held = tables[table]
        counts.update({i: u for i, u in zip(held["ids"].tolist(), held["updates"].tolist()) if u})
    return counts
