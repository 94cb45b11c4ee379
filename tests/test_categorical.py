"""Categorical features: the numpy layers' semantics (the hash against its documented formula,
vocabularies merged exactly across shards, out-of-vocabulary buckets, np.digitize buckets, one
table over several fields), and prepare-data keeping string columns and recording their specs."""

import collections
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from elastic_step.data.categorical import (Bucketize, ConcatWithOffset, Hashing, Lookup, hash_ints, hash_strings,
                                           salt_seed)
from elastic_step.data.categorical_analysis import ValueCounts
from elastic_step.errors import DataError

# The hash as categorical.py documents it, one value at a time in Python integers.
MASK = (1 << 64) - 1
M1, M2, GOLDEN = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x9E3779B97F4A7C15
INT_DOMAIN, STRING_DOMAIN = 0x6A09E667F3BCC908, 0xBB67AE8584CAA73B  # SHA-512's first two IV words


def fmix(x: int) -> int:
    x ^= x >> 33
    x = (x * M1) & MASK
    x ^= x >> 33
    x = (x * M2) & MASK
    return x ^ (x >> 33)


def reference_string_hash(text: str, seed: int = 0) -> int:
    data = text.encode("utf-8")
    words = [int.from_bytes(data[i:i + 8].ljust(8, b"\0"), "little") for i in range(0, max(len(data), 1), 8)]
    total = sum(fmix(w ^ ((j * GOLDEN + (seed ^ STRING_DOMAIN)) & MASK)) for j, w in enumerate(words)) & MASK
    return fmix((total + len(data) * GOLDEN) & MASK)


def reference_int_hash(value: int, seed: int = 0) -> int:
    return fmix((value & MASK) ^ seed ^ INT_DOMAIN)


def random_strings(rng, n):
    alphabet = list("abcxyz019-_ ") + ["é", "ü", "漢", "🙂"]
    texts = ["".join(rng.choice(alphabet, size=rng.integers(0, 40))) for _ in range(n)]
    return texts + ["", "a", "12345678", "123456789", "x" * 1000, "\0", "\0\0"]


def test_string_hash_is_the_documented_formula():
    rng = np.random.default_rng(1)
    texts = random_strings(rng, 300)
    for salt in (None, "criteo", 7):
        seed = salt_seed(salt)
        assert seed == (0 if salt is None else reference_string_hash(str(salt)))
        got = hash_strings(np.array(texts, dtype=object), seed)
        assert got.tolist() == [reference_string_hash(t, seed) for t in texts]
    # Every input form of the same strings hashes alike, and a slice of an Arrow array too.
    arrow = pa.array(["pad", *texts])
    assert hash_strings(arrow.slice(1)).tolist() == hash_strings(texts).tolist()
    plain = [t for t in texts if "\0" not in t]  # numpy's fixed-width str drops trailing NULs
    assert hash_strings(np.array(plain)).tolist() == hash_strings(plain).tolist()


def test_int_hash_is_the_documented_formula():
    values = [0, 1, -1, 2**63 - 1, -2**63, 42, 1 << 40]
    for seed in (0, salt_seed("x")):
        assert hash_ints(np.array(values, dtype=np.int64), seed).tolist() == [reference_int_hash(v, seed) for v in values]
    assert hash_ints(np.array([0, 1], dtype=np.int32)).tolist() == hash_ints([0, 1]).tolist()
    assert hash_ints(np.array([True, False])).tolist() == hash_ints([1, 0]).tolist()
    with pytest.raises(DataError, match="float64.*Bucketize"):
        Hashing(10)(np.array([1.5]))


def test_ids_are_the_same_in_another_process_whatever_its_hash_seed():
    """Python's hash() of a str changes with PYTHONHASHSEED; ids must not."""
    values = ["ad-1", "ad-2", "", "ünï"]
    code = ("import json; from elastic_step.data.categorical import Hashing, Lookup; "
            f"print(json.dumps([Hashing(97, salt='s')({values!r}).tolist(), Hashing(97)([3, -3]).tolist(), "
            f"Lookup(['x', 'y'], num_oov_buckets=5)({values!r}).tolist()]))")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")]
    here = [Hashing(97, salt="s")(values).tolist(), Hashing(97)([3, -3]).tolist(),
            Lookup(["x", "y"], num_oov_buckets=5)(values).tolist()]
    assert json.loads(runs[0]) == json.loads(runs[1]) == here


def test_hashing_spreads_values_over_its_bins_and_keeps_the_shape():
    layer = Hashing(16)
    ids = layer(np.array([f"user-{i}" for i in range(16_000)], dtype=object))
    assert ids.dtype == np.int64 and ids.min() >= 0 and ids.max() < 16
    counts = np.bincount(ids, minlength=16)
    assert counts.min() > 800 and counts.max() < 1200, counts  # 1000 expected per bin
    grid = np.array([["a", "b"], ["c", "a"]], dtype=object)
    assert layer(grid).shape == (2, 2) and layer(grid)[0, 0] == layer(grid)[1, 1]
    salted = Hashing(1 << 20, salt="other")(np.arange(100))
    assert (salted != Hashing(1 << 20)(np.arange(100))).mean() > 0.9
    with pytest.raises(DataError, match="num_bins"):
        Hashing(0)


def test_lookup_gives_vocabulary_ids_then_out_of_vocabulary_buckets():
    layer = Lookup(["red", "green", "blue"], num_oov_buckets=4)
    assert layer.num_ids == 7
    assert layer(np.array(["blue", "red", "green"], dtype=object)).tolist() == [2, 0, 1]
    unseen = np.array([f"colour-{i}" for i in range(400)], dtype=object)
    oov = layer(unseen)
    assert set(oov.tolist()) == {3, 4, 5, 6}  # every bucket used, none below the vocabulary's size
    assert oov.tolist() == layer(unseen[::-1])[::-1].tolist()  # a value's bucket does not depend on the batch
    assert (oov - 3).tolist() == Hashing(4)(unseen).tolist()
    assert Lookup(["a"], num_oov_buckets=0)(["a", "b"]).tolist() == [0, -1]  # ElasticDL's default
    assert Lookup(["a"], num_oov_buckets=0, default=9)(["b"]).tolist() == [9]
    numbers = Lookup([10, 30, 20], num_oov_buckets=1)
    assert numbers(np.array([20, 10, 99, 30])).tolist() == [2, 0, 3, 1]
    with pytest.raises(DataError, match="twice"):
        Lookup(["a", "b", "a"])


def test_vocabulary_counts_merge_exactly_across_shards():
    rng = np.random.default_rng(3)
    values = np.array([f"v{k}" for k in rng.zipf(1.3, 200_000) % 100_000], dtype=object)
    truth = collections.Counter(values.tolist())
    cuts = np.sort(rng.choice(len(values), 7, replace=False))
    shards = np.split(values, cuts)
    for order in (range(len(shards)), reversed(range(len(shards)))):
        total = ValueCounts()
        for index in order:
            shard = ValueCounts()
            shard.update(pa.array(shards[index]))
            total.merge(shard)
        assert total.distinct() == len(truth)
        for least in (1, 3):
            expected = sorted((v for v, c in truth.items() if c >= least), key=lambda v: (-truth[v], v))
            assert total.vocabulary(least) == expected


def test_bucketize_is_np_digitize():
    bounds = [-1.0, 0.0, 2.5, 10.0]
    values = np.concatenate([np.random.default_rng(4).normal(0, 5, 1000), bounds, [np.nan, np.inf, -np.inf]])
    assert Bucketize(bounds)(values).tolist() == np.digitize(values, bounds).tolist()
    assert Bucketize(bounds).num_ids == 5 and Bucketize(bounds)([-1.0, 0.0]).tolist() == [1, 2]  # left edge inside
    for bad in ([1, 1, 2], [3, 2], [0, float("nan")]):
        with pytest.raises(DataError, match="strictly increasing"):
            Bucketize(bad)


def test_concat_with_offset_puts_fields_side_by_side_in_one_table():
    layer = ConcatWithOffset([3, 5, 2], names=["a", "b", "c"])
    assert layer.num_ids == 10 and layer.offsets.tolist() == [0, 3, 8]
    assert layer([[0, 2], [4, 0], [1, 1]]).tolist() == [[0, 7, 9], [2, 3, 9]]
    with pytest.raises(DataError, match=r"ids of b must lie in \[0, 5\), found 5"):
        layer([[0], [5], [0]])
    with pytest.raises(DataError, match="found -1"):
        layer([[0], [-1], [0]])
