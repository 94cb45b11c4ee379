"""`train --mode ps`: the embedding tables on parameter-server shards the master starts.

Unit level: a PsEmbedding's pulled rows and merged gradients are nn.Embedding's; a frozen table
is a plain torch model (traceable, exported whole); a push's key names the rows, not the task
that carried them; bad flag combinations are refused before anything starts.

End to end: a DeepFM job with two workers and two shards, one worker SIGKILLed mid-epoch (a real
signal): each embedding row's update counter on the shards equals the count computed from the
data alone (every minibatch updates each of its distinct ids once), so no re-issued minibatch
was applied twice and none was lost.
"""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import cli

from elastic_step.ps.torch_embedding import PsEmbedding, freeze_tables
from elastic_step.worker.ps_step import push_key

DEEPFM_PS = "elastic_step.model_zoo.deepfm_ps_torch"


def test_pulled_rows_and_merged_gradients_are_nn_embeddings():
    torch.manual_seed(0)
    reference = torch.nn.Embedding(50, 4)
    table = PsEmbedding("t", 4)
    pulls = []

    def pull(ids):
        pulls.append(ids.copy())
        return reference.weight.detach().numpy()[ids]

    table.source = pull
    ids = torch.tensor([[3, 7, 3], [49, 7, 0]])
    weights = torch.randn(2, 3, 4)
    (table(ids) * weights).sum().backward()
    (reference(ids) * weights).sum().backward()
    assert pulls[0].tolist() == [0, 3, 7, 49]  # each distinct id pulled once
    got_ids, grads = table.take_gradients()
    assert got_ids.tolist() == [0, 3, 7, 49]
    np.testing.assert_allclose(grads, reference.weight.grad.numpy()[got_ids], rtol=1e-6)
    assert table.take_gradients() is None  # taken once


def test_a_frozen_table_is_plain_torch_and_exported_whole():
    table = PsEmbedding("frozen_t", 2)
    freeze_tables({"frozen_t": (np.array([10, 2, 7]), np.array([[1, 1], [2, 2], [3, 3]], np.float32))})
    later = PsEmbedding("frozen_t", 2)  # made after the freeze: adopts it too
    ids = torch.tensor([[2, 7], [10, 99]])
    expected = [[[2, 2], [3, 3]], [[1, 1], [0, 0]]]  # 99 was never trained: a zero row
    assert table(ids).tolist() == later(ids).tolist() == expected
    traced = torch.jit.trace(table.eval(), ids)
    assert traced(torch.tensor([[7, 10]])).tolist() == [[[3, 3], [1, 1]]]


def test_an_unbound_table_refuses_to_train_but_predicts_its_initial_rows():
    table = PsEmbedding("unbound_t", 3, init_scale=0.5)
    with pytest.raises(RuntimeError, match="--mode ps"):
        table(torch.tensor([1, 2]))
    with torch.no_grad():
        rows = table(torch.tensor([1, 2, 1]))
    assert rows.shape == (3, 3) and rows[0].tolist() == rows[2].tolist() and rows.abs().max() <= 0.5


def test_a_push_key_names_the_rows_whichever_task_carries_them():
    # Task 12 held rows 256..511 of data shard 3 in epoch 1; its worker died after 128 rows and
    # the master re-issued rows 384..511 as a new task: the minibatch at row 384 has one key.
    first = push_key(epoch=1, shard=3, first_row=256 + 128, minibatch_size=64)
    again = push_key(epoch=1, shard=3, first_row=384, minibatch_size=64)
    assert first == again == ((1 << 32) | 3, 6)
    assert push_key(2, 3, 384, 64) != first and push_key(1, 4, 384, 64) != first
    with pytest.raises(ValueError, match="grid"):
        push_key(1, 3, 100, 64)


@pytest.mark.parametrize("extra, words", [
    (["--global-batch-size", "128"], "drop --global-batch-size"),
    (["--ps-shards", "0"], "--ps-shards must be between 1 and 128"),
    (["--backend", "kubernetes"], "local backend only"),
])
def test_bad_ps_flags_are_one_line_and_start_nothing(tmp_path, extra, words):
    done = cli("train", "--model-def", DEEPFM_PS, "--data", str(tmp_path / "nowhere"), "--job-dir", str(tmp_path / "job"),
               "--mode", "ps", *extra)
    assert done.returncode == 2, done.stderr
    assert words in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "job").exists()
