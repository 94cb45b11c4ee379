"""prepare-data with string columns: --categorical and --buckets specs (or `auto`), vocabularies
and boundaries from the training split recorded in the manifest (a large vocabulary in a hashed
file beside it), the spilling shuffle carrying strings, the bad-input lines, and a model
definition's sparse features giving the same ids to PyTorch and Keras, and training on them."""

import collections
import hashlib
import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest

from conftest import cli
from elastic_step.audit import audit_report
from elastic_step.data.manifest import load_manifest, validate_shards
from elastic_step.data.reader import ShardReader
from elastic_step.errors import DataError

HERE = os.path.dirname(__file__)
SPARSE_TORCH = os.path.join(HERE, "model_defs", "sparse_torch.py")
SPARSE_KERAS = os.path.join(HERE, "model_defs", "sparse_keras.py")
SPECS = ["--categorical", "site=hash:64;device=vocab:oov=2", "--buckets", "age=quantiles:4"]


def ads_table(rows: int, seed: int = 0, users: int = 0) -> pa.Table:
    """Ad clicks: a Zipf-distributed site, a device with a rare value, an age, a number, and
    (with `users`) a column of many distinct strings. The label depends on device and age."""
    rng = np.random.default_rng(seed)
    device = rng.choice(["ios", "android", "web", "tv"], rows, p=[0.45, 0.4, 0.149, 0.001])
    age = rng.integers(16, 80, rows)
    label = (((device == "ios") | (age > 47)) ^ (rng.random(rows) < 0.05)).astype(np.int64)
    columns = {"site": [f"site-{k}" for k in rng.zipf(1.4, rows) % 500], "device": device, "age": age,
               "x": rng.normal(size=rows).round(3), "label": label}
    if users:
        columns["user"] = [f"user-{k:08d}" for k in rng.integers(0, users, rows)]
    return pa.table(columns)


@pytest.fixture(scope="module")
def ads_csv(tmp_path_factory):
    path = tmp_path_factory.mktemp("ads") / "ads.csv"
    pacsv.write_csv(ads_table(3000), str(path))
    return str(path)


@pytest.fixture(scope="module")
def ads(ads_csv, tmp_path_factory):
    """The CSV prepared by the command a user types."""
    out = tmp_path_factory.mktemp("ads-prepared")
    done = cli("prepare-data", "--source", ads_csv, "--out", str(out), "--rows-per-shard", "400", *SPECS,
               "--outputs", str(out / "outputs"), timeout=120)
    assert done.returncode == 0, done.stderr
    return out, done.stdout


def train_column(out, column):
    return ShardReader(load_manifest(str(out))).read_split("train", columns=[column])[column]


def test_prepare_data_keeps_string_columns_and_records_their_specs(ads):
    out, stdout = ads
    manifest = json.load(open(out / "manifest.json"))
    assert manifest["schema"]["site"] == "string" and manifest["schema"]["device"] == "string"
    recorded = manifest["categorical"]
    assert recorded["site"] == {"encoding": "hash", "num_bins": 64}
    # The vocabulary is the training split's, exactly: most frequent first, ties by value.
    devices = collections.Counter(train_column(out, "device").tolist())
    assert recorded["device"]["vocabulary"] == sorted(devices, key=lambda v: (-devices[v], v))
    assert recorded["device"]["num_oov_buckets"] == 2
    bounds = recorded["age"]["boundaries"]
    ages = train_column(out, "age")
    shares = np.bincount(np.digitize(ages, bounds)) / len(ages)
    assert len(bounds) == 3 and all(0.15 < s < 0.35 for s in shares), (bounds, shares)
    assert "categorical site: hashed into 64 bins -> 64 ids" in stdout
    assert "categorical device: vocabulary of" in stdout and "categorical age: 4 buckets" in stdout
    summary = open(out / "outputs" / "summary.md").read()
    assert "| device | vocabulary |" in summary and "| age | buckets | 4 |" in summary
    assert train_column(out, "site")[0].startswith("site-")  # the shards keep the strings themselves


def test_auto_infers_a_vocabulary_or_hashing_and_says_which(tmp_path):
    source = tmp_path / "users.csv"
    pacsv.write_csv(ads_table(15_000, users=10_000_000), str(source))  # ~12k distinct in train
    done = cli("prepare-data", "--source", str(source), "--out", str(tmp_path / "out"), "--categorical", "auto",
               "--features", "site,device,user,x", "--rows-per-shard", "2000", timeout=120)
    assert done.returncode == 0, done.stderr
    recorded = json.load(open(tmp_path / "out" / "manifest.json"))["categorical"]
    assert recorded["device"]["encoding"] == "vocabulary" and recorded["device"]["inferred"]
    assert recorded["user"]["encoding"] == "hash" and recorded["user"]["num_bins"] >= 2 * 10_000
    assert "categorical user: hashed into" in done.stdout and "(inferred)" in done.stdout


def test_a_large_vocabulary_lives_beside_the_manifest_hashed(tmp_path):
    source = tmp_path / "users.csv"
    pacsv.write_csv(ads_table(8000, users=6000), str(source))
    out = tmp_path / "out"
    done = cli("prepare-data", "--source", str(source), "--out", str(out), "--categorical", "user=vocab;site;device",
               "--rows-per-shard", "1000", timeout=120)
    assert done.returncode == 0, done.stderr
    spec = json.load(open(out / "manifest.json"))["categorical"]["user"]
    assert "vocabulary" not in spec
    data = open(out / spec["vocabulary_file"], "rb").read()
    assert hashlib.sha256(data).hexdigest() == spec["vocabulary_sha256"]
    users = collections.Counter(train_column(out, "user").tolist())
    assert json.loads(data) == sorted(users, key=lambda v: (-users[v], v)) and spec["vocabulary_size"] == len(users)
    manifest = load_manifest(str(out))
    validate_shards(manifest)
    layer = manifest.categorical["user"].layer()
    assert layer(np.array(json.loads(data)[:3], dtype=object)).tolist() == [0, 1, 2]
    (out / spec["vocabulary_file"]).write_bytes(data.replace(b"user-", b"USER-", 1))
    with pytest.raises(DataError, match="vocabulary of column 'user' .* has changed"):
        validate_shards(load_manifest(str(out)))
    os.remove(out / spec["vocabulary_file"])
    with pytest.raises(DataError, match="vocabulary of column 'user' is missing from the dataset"):
        validate_shards(load_manifest(str(out)))


def test_the_spilling_shuffle_carries_string_columns(tmp_path, monkeypatch):
    from elastic_step.data import shuffle
    from elastic_step.data.prepare import prepare_data

    spills = []
    start = shuffle.ExternalShuffle._start_spilling
    monkeypatch.setattr(shuffle.ExternalShuffle, "_start_spilling", lambda self: (spills.append(1), start(self)))
    table = ads_table(6000, seed=5)
    pacsv.write_csv(table, str(tmp_path / "ads.csv"))
    manifest = prepare_data(str(tmp_path / "ads.csv"), str(tmp_path / "out"), rows_per_shard=500,
                            memory_bytes=32 << 10, categorical="site;device")
    assert spills, "the source should not fit the 32 KiB budget"
    reader = ShardReader(load_manifest(str(tmp_path / "out")))
    rows = [reader.read_split(split) for split in ("train", "val", "test")]
    written = sorted(zip(*(np.concatenate([r[c] for r in rows]).tolist() for c in ("site", "device", "age", "x"))))
    assert written == sorted(zip(*(table.column(c).to_pylist() for c in ("site", "device", "age", "x"))))
    sites = collections.Counter(rows[0]["site"].tolist())
    assert manifest.categorical["site"].vocabulary == sorted(sites, key=lambda v: (-sites[v], v))


@pytest.mark.parametrize("args,words", [
    ([], ["feature column 'site'", "type string", "--categorical site=vocab"]),
    (["--categorical", "site;device;city=hash:8"], ["--categorical names column 'city'", "not in", "site, device"]),
    (["--categorical", "site;device", "--buckets", "age=40,30"], ["--buckets 'age=40,30'", "not strictly increasing"]),
    (["--categorical", "site;device", "--buckets", "age=18,18,50"], ["not strictly increasing"]),
    (["--categorical", "site=hash:0;device"], ["BINS must be an integer >= 1"]),
    (["--categorical", "site=lookup;device"], ["'lookup' is not an encoding"]),
    (["--categorical", "site", "--buckets", "device=1,2"], ["--buckets names column 'device'", "numbers"]),
    (["--categorical", "site;device;x"], ["--categorical names column 'x'", "--buckets"]),
])
def test_bad_categorical_input_is_one_line_and_writes_nothing(ads_csv, tmp_path, args, words):
    done = cli("prepare-data", "--source", ads_csv, "--out", str(tmp_path / "out"), *args, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("elastic-step prepare-data: error:"), done.stderr
    for word in words:
        assert word in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


def test_torch_and_keras_model_definitions_get_the_same_ids(ads):
    """One process (TensorFlow's import is slow): both model definitions feed one batch."""
    from elastic_step.frameworks.model_def import load_model_definition
    from elastic_step.frameworks.registry import build_trainer

    out, _ = ads
    batch = ShardReader(load_manifest(str(out))).read("val", 0, 0, 64)
    fed = {}
    for name, source in (("torch", SPARSE_TORCH), ("keras", SPARSE_KERAS)):
        model_def = load_model_definition(source)
        features, labels = model_def.feed(batch)
        trainer = build_trainer(model_def, seed=0)
        assert np.asarray(trainer.predict(features)).shape == (64, 2)
        fed[name] = features
    assert np.array_equal(fed["torch"], fed["keras"])
    ids = fed["torch"][:, :3].astype(np.int64)
    sizes = [64, 4 + 2, 4]  # site's bins; device's vocabulary and 2 oov buckets; age's buckets
    assert ids.min() >= 0 and (ids[:, 0] < 64).all() and (ids[:, 1] - 64 < 6).all() and (ids[:, 2] - 70 < 4).all()
    assert ids.max() < sum(sizes)


def test_a_job_trains_on_sparse_features_with_its_audit_clean(ads, start_job):
    out, _ = ads
    job = start_job("--model-def", SPARSE_TORCH, "--data", str(out), "--workers", "1:1", "--epochs", "1",
                    "--minibatch-size", "32")
    assert job.finish() == 0, job.output()
    report = audit_report(job.audit, str(out), 1)
    assert report["exact"] and report["rows_applied"] == report["rows_expected"], report
    assert job.result()["test_metrics"]["accuracy"] > 0.75, job.result()  # it learns from the ids


def bad_train(tmp_path, data, words):
    job_dir = tmp_path / "job"
    done = cli("train", "--model-def", SPARSE_TORCH, "--data", str(data), "--job-dir", str(job_dir), "--no-progress",
               timeout=180)
    assert done.returncode == 2, done.stderr
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith("elastic-step train: error:"), done.stderr
    for word in words:
        assert word in message, message
    assert not (job_dir / "logs").exists() or not os.listdir(job_dir / "logs"), "no worker may have started"


def test_training_refuses_a_sparse_feature_the_manifest_has_no_spec_for(ads_csv, tmp_path):
    out = tmp_path / "data"
    done = cli("prepare-data", "--source", ads_csv, "--out", str(out), "--features", "device,age,x",
               "--categorical", "device", "--buckets", "age=30,50", timeout=60)
    assert done.returncode == 0, done.stderr
    bad_train(tmp_path, out, ["sparse feature 'site'", "no vocabulary, hash or buckets", "--categorical site="])


def test_training_refuses_a_dataset_whose_vocabulary_file_is_gone(tmp_path):
    source = tmp_path / "users.csv"
    pacsv.write_csv(ads_table(6000, users=1_000_000), str(source))  # a vocabulary of ~80 KB
    out = tmp_path / "data"
    done = cli("prepare-data", "--source", str(source), "--out", str(out), "--categorical", "site=vocab;device;user=vocab",
               "--buckets", "age=30,50", timeout=60)
    assert done.returncode == 0, done.stderr
    shutil.rmtree(out / "vocabularies")
    bad_train(tmp_path, out, ["vocabulary of column", "missing from the dataset", "prepare-data"])


def test_the_shuffle_never_holds_a_string_table_past_the_32_bit_offsets(monkeypatch):
    """Arrow's take concatenates a column's chunks, and a string column overflows past 2 GiB of
    text: with string columns the shuffle spills before that, whatever memory it was given (the
    limit is made small here; the same rows as numbers stay in memory)."""
    from elastic_step.data import shuffle

    monkeypatch.setattr(shuffle, "STRING_TABLE_BYTES", 256 << 10)
    rng = np.random.default_rng(6)
    words = pa.array([f"value-{k:012d}" for k in rng.integers(0, 10**12, 40_000)])
    numbers = pa.array(rng.integers(0, 10**12, 120_000))
    assert numbers.nbytes > words.nbytes > 512 << 10
    texts = shuffle.ExternalShuffle(pa.schema([("w", pa.string())]), 0, memory_bytes=1 << 30)
    counts = shuffle.ExternalShuffle(pa.schema([("n", pa.int64())]), 0, memory_bytes=1 << 30)
    for start in range(0, 40_000, 4000):
        texts.add(pa.record_batch([words.slice(start, 4000)], names=["w"]))
    counts.add(pa.record_batch([numbers], names=["n"]))
    assert texts.spilled and not counts.spilled
    out = pa.concat_tables(list(texts.rows())).column("w")
    assert sorted(out.to_pylist()) == sorted(words.to_pylist())
    counts.close()
