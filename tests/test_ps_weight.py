"""A dense weight kept on the parameter-server shards (PsWeight) in a real `train --mode ps` job.

A small click model whose output layer's weight is a PsWeight, beside a PsEmbedding for the ids,
trained by two workers against two shards: the job succeeds with an exact audit; every training
minibatch pushes the weight's gradient once, so each of its rows was updated exactly as many
times as there are minibatches (no push lost, none applied twice) and moved from its initial
values; and the final model (the weights file with the tables the run froze beside it) predicts
what its hidden layer times the weight read from the shards' snapshots gives.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from conftest import synthetic_clicks

MINIBATCH, EPOCHS, SHARDS = 128, 1, 2
OUT = "wide_out"

# Two logits (no-click, click) from a PsWeight as nn.Linear(HIDDEN, 2)'s weight: each minibatch's
# gradient reaches both rows, and the click's logit is their difference.
WIDE_OUT_MODEL = f"""
import torch
from torch import nn

from elastic_step.model_zoo.ctr_features import DENSE, SPARSE, feed, metrics  # noqa: F401
from elastic_step.ps.torch_embedding import PsEmbedding, PsWeight

HIDDEN = 8


class WideOut(nn.Module):
    def __init__(self, fields, dense):
        super().__init__()
        self.fields = fields
        self.table = PsEmbedding("wide_ids", 4, lr=0.05, rows=SPARSE.num_ids)
        self.hidden = nn.Linear(fields * 4 + dense, HIDDEN)
        self.out = PsWeight("{OUT}", 2, HIDDEN, lr=0.05)

    def features(self, packed):
        ids, dense = packed[:, :self.fields].long(), packed[:, self.fields:].float()
        return torch.relu(self.hidden(torch.cat([self.table(ids).flatten(1), dense], dim=1)))

    def forward(self, packed):
        logits = self.features(packed) @ self.out().T
        return logits[:, 1] - logits[:, 0]


def model():
    return WideOut(len(SPARSE.columns), 2 * len(DENSE))


def loss(outputs, labels):
    return nn.functional.binary_cross_entropy_with_logits(outputs, labels.float())


def optimizer(net):
    return torch.optim.Adam(net.parameters(), lr=1e-2)
"""


@pytest.fixture(scope="module")
def clicks(tmp_path_factory) -> str:
    return synthetic_clicks(tmp_path_factory.mktemp("ctr") / "data", rows=2000, seed=7, rows_per_shard=500)


def test_a_dense_weight_on_the_shards_is_pushed_once_per_minibatch_and_is_what_the_final_model_holds(
        clicks, start_job, tmp_path):
    import torch

    from elastic_step.audit import audit_report
    from elastic_step.data.manifest import load_manifest
    from elastic_step.frameworks.model_def import load_model_definition
    from elastic_step.frameworks.registry import build_trainer
    from elastic_step.master.ps_rows import snapshot_table
    from elastic_step.master.ps_tables import table_specs
    from elastic_step.ps.embedding import TABLES_FILE, hold_tables, read_tables
    from elastic_step.ps.expected_updates import expected_updates, updates_on_the_shards
    from elastic_step.ps.table import initial_weights
    from elastic_step.release.candidate import split_head

    model_file = tmp_path / "wide_out.py"
    model_file.write_text(WIDE_OUT_MODEL)
    job = start_job("--model-def", str(model_file), "--data", clicks, "--mode", "ps", "--ps-shards", str(SHARDS),
                    "--workers", "2", "--epochs", str(EPOCHS), "--minibatch-size", str(MINIBATCH),
                    "--checkpoint-steps", "0")
    assert job.finish(timeout=600) == 0, job.output()
    report = audit_report(job.audit, clicks, epochs=EPOCHS)
    assert report["exact"], report

    # Every minibatch uses every row of the weight: each row's counter is the number of pushes.
    minibatches = EPOCHS * sum(math.ceil(s.rows / MINIBATCH) for s in load_manifest(clicks).splits["train"])
    assert updates_on_the_shards(job.job_dir, OUT) == {0: minibatches, 1: minibatches}
    # The embedding beside it: each distinct id of each minibatch once, as the data says.
    assert updates_on_the_shards(job.job_dir, "wide_ids") == expected_updates(clicks, str(model_file), MINIBATCH, EPOCHS)

    model_def = load_model_definition(str(model_file))
    spec = {s.name: s for s in table_specs(str(model_file))}[OUT]
    ids, rows = snapshot_table(spec, [os.path.join(job.job_dir, "ps", f"shard-{i}") for i in range(SHARDS)])
    weight = rows[np.argsort(ids)]
    assert sorted(ids.tolist()) == [0, 1] and weight.shape == (2, spec.dim)
    assert not np.allclose(weight, initial_weights(spec, np.arange(2)), atol=1e-4)  # trained on the shards

    # The final model as the release steps rebuild it: the weights file, the tables beside it.
    trainer = build_trainer(model_def)
    with open(os.path.join(job.job_dir, "model", "model.bin"), "rb") as f:
        trainer.load_model_bytes(f.read())
    assert not [name for name, _ in trainer.net.named_parameters() if name.startswith("out.")]  # no worker's parameter
    hold_tables(trainer.net, read_tables(os.path.join(job.job_dir, "model", TABLES_FILE)))
    features = split_head(clicks, model_def, rows=64)
    with torch.no_grad():
        hidden = trainer.net.features(torch.from_numpy(features)).numpy()
    logits = hidden @ weight.T
    np.testing.assert_allclose(trainer.predict(features), logits[:, 1] - logits[:, 0], rtol=1e-5, atol=1e-6)
