"""The Criteo-shaped click log (`prepare-data --source synthetic:criteo?rows=N`) and the DeepFM
model definition that trains on it: the data is what a sparse-model benchmark needs (Criteo's
columns, Zipf ids, labels from a known probability, exact per-value counts), and a DeepFM job on
it learns, through a worker's SIGKILL, with every row applied exactly once."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pytest
from conftest import cli, synthetic_clicks

from elastic_step.audit import audit_report
from elastic_step.data import synthetic_ctr as ctr

DEEPFM = "elastic_step.model_zoo.deepfm_torch"
DEEPFM_KERAS = "elastic_step.model_zoo.deepfm_keras"


@pytest.fixture(scope="module")
def clicks(tmp_path_factory) -> str:
    return synthetic_clicks(tmp_path_factory.mktemp("ctr") / "data", rows=12000, seed=5, rows_per_shard=1000)


def table(spec: ctr.CtrSpec, with_truth: bool = False) -> pa.Table:
    return pa.Table.from_batches(list(ctr.blocks(spec, with_truth)))


def test_the_log_has_criteos_columns_and_is_the_same_every_time():
    spec = ctr.CtrSpec(rows=ctr.BLOCK + 100, seed=3)
    first = table(spec)
    assert first.column_names == ctr.DENSE + ctr.CATEGORICAL + ["label"]  # no truth unless asked for
    assert first.equals(table(spec))
    assert not first.equals(table(ctr.CtrSpec(rows=ctr.BLOCK + 100, seed=4)))
    values = first.column("C1").to_pylist()
    assert all(len(v) == 8 and int(v, 16) >= 0 for v in values)  # 8 hex characters, as Criteo's
    dense = first.column("I1").to_numpy()
    missing = (dense == ctr.MISSING_DENSE).mean()
    assert 0.04 < missing < 0.41 and dense[dense >= 0].min() >= 0


def test_every_block_stands_alone_so_exact_counts_are_known():
    long = table(ctr.CtrSpec(rows=3 * ctr.BLOCK, seed=1))
    short = table(ctr.CtrSpec(rows=2 * ctr.BLOCK + 5, seed=1))
    assert long.slice(0, 2 * ctr.BLOCK + 5).equals(short)  # a longer log only adds blocks
    spec = ctr.CtrSpec(rows=2 * ctr.BLOCK + 5, seed=1)
    for column in ("C1", "C6", "C20"):
        assert ctr.value_counts(spec, column) == Counter(short.column(column).to_pylist())


def test_ids_follow_zipf_with_fresh_values_and_labels_follow_the_planted_probability():
    spec = ctr.CtrSpec(rows=4 * ctr.BLOCK, unseen=0.03)
    data = table(spec, with_truth=True)
    counts = Counter(data.column("C1").to_pylist())
    top = [n for _, n in counts.most_common(3)]
    assert top[0] > 1.8 * top[1] and top[1] > 1.3 * top[2]  # Zipf's head: 2^1.15 = 2.2, 1.5^1.15 = 1.6
    singletons = sum(1 for n in counts.values() if n == 1)
    assert singletons > 0.02 * len(data)  # the fresh values (3 % of rows) almost never recur
    p = data.column(ctr.TRUE_PROBABILITY).to_numpy().astype(np.float64)
    labels = data.column("label").to_numpy()
    assert abs(labels.mean() - p.mean()) < 0.02  # labels drawn from the truth
    base = -np.mean(labels * np.log(labels.mean()) + (1 - labels) * np.log(1 - labels.mean()))
    assert ctr.bayes_log_loss(p) < base - 0.1  # there is something to learn
    assert len(ctr.CtrSpec(rows=1, scale=1.0).cardinalities) == 26
    assert ctr.CtrSpec(rows=1, scale=1.0).cardinalities[0] == 45833188  # Criteo-1TB's C1


@pytest.mark.parametrize("source, words", [
    ("synthetic:criteo", "say how many rows"),
    ("synthetic:criteo?rows=10&speed=3", "unknown parameter 'speed'"),
    ("synthetic:criteo?rows=ten", "rows='ten' is not a number"),
    ("synthetic:criteo?rows=10&scale=2", "scale=2.0"),
    ("synthetic:avazu?rows=10", "unknown source"),
])
def test_a_bad_synthetic_source_is_one_line_and_writes_nothing(tmp_path, source, words):
    done = cli("prepare-data", "--source", source, "--out", str(tmp_path / "out"))
    assert done.returncode == 2, done.stderr
    message = done.stderr.strip().splitlines()[-1]
    assert words in message and source in message, message
    assert not (tmp_path / "out").exists()


def test_deepfm_learns_the_clicks_through_a_sigkill_with_every_row_exactly_once(clicks, start_job):
    job = start_job("--model-def", DEEPFM, "--data", clicks, "--workers", "2:2", "--epochs", "3",
                    "--minibatch-size", "64", "--minibatches-per-task", "4")
    status = job.wait_for(lambda s: s["world_size"] == 2 and s["rows_done"] > 0.3 * s["rows_total"], timeout=300)
    job.kill_worker(status, rank=1)
    assert job.finish(timeout=600) == 0, job.output()
    report = audit_report(job.audit, clicks, 3)
    assert report["exact"] and report["rows_applied"] == report["rows_expected"], report
    test = job.result()["test_metrics"]
    assert test["auc"] > 0.65, test  # a ranking far better than chance
    assert test["log_loss"] == pytest.approx(test["loss"], rel=1e-4)  # the gate's metric is the loss it trained on


def test_the_keras_deepfm_trains_on_the_same_features(clicks, start_job):
    job = start_job("--model-def", DEEPFM_KERAS, "--data", clicks, "--workers", "1", "--epochs", "2",
                    "--minibatch-size", "64", "--minibatches-per-task", "4")
    assert job.finish(timeout=600) == 0, job.output()
    report = audit_report(job.audit, clicks, 2)
    assert report["exact"], report
    test = job.result()["test_metrics"]
    assert test["auc"] > 0.65, test
