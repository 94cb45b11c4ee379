"""Data preparation, manifests and shard reading: local tmp files and sklearn's bundled digits only."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elastic_step.data.manifest import MANIFEST_NAME, Manifest, load_manifest, validate_shards
from elastic_step.data.prepare import prepare_data
from elastic_step.data.summary import class_balance
from elastic_step.data.reader import ShardReader, default_feed
from elastic_step.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    out = tmp_path_factory.mktemp("digits")
    return prepare_data("sklearn:digits", str(out), rows_per_shard=300, row_group_rows=64, seed=0)


def _table(n=40, seed=1):
    rng = np.random.default_rng(seed)
    return pa.table({
        "a": rng.normal(size=n),
        "b": rng.integers(0, 10, size=n),
        "name": [f"row{i}" for i in range(n)],
        "y": rng.integers(0, 3, size=n),
    })


# --- preparing --------------------------------------------------------------------------------

def test_digits_manifest_loads_and_adds_up(digits):
    m = load_manifest(digits.root)
    assert m == digits
    assert m.root == digits.root
    assert sum(m.rows(s) for s in ("train", "val", "test")) == 1797
    assert (m.rows("train"), m.rows("val"), m.rows("test")) == (1437, 180, 180)
    assert m.features == [f"pixel_{i}" for i in range(64)] and m.label == "label"
    assert m.schema["pixel_0"] == "float32" and m.schema["label"] == "int64"
    for shards in m.splits.values():
        assert all(0 < s.rows <= 300 for s in shards)
    assert m.shard_uri("train", 1) == f"{digits.root}/train/part-00001.parquet"
    validate_shards(m, ("train", "val", "test"))
    # Loading the file itself works as well as its folder.
    assert load_manifest(f"{digits.root}/{MANIFEST_NAME}") == m


def test_content_hash_depends_on_seed_only(tmp_path, digits):
    again = prepare_data("sklearn:digits", str(tmp_path / "a"), rows_per_shard=300, seed=0)
    other = prepare_data("sklearn:digits", str(tmp_path / "b"), rows_per_shard=300, seed=1)
    assert again.content_hash == digits.content_hash
    assert other.content_hash != digits.content_hash


def test_rows_columns_and_class_balance(digits):
    assert {name: digits.rows(name) for name in digits.splits} == {"train": 1437, "val": 180, "test": 180}
    assert len(digits.schema) == 65 and len(digits.features) == 64
    balance = class_balance(digits)
    assert sorted(balance, key=int) == [str(c) for c in range(10)]
    assert sum(balance.values()) == 1437


@pytest.mark.parametrize("name,n", [("iris", 150), ("wine", 178)])
def test_other_sklearn_sets_have_clean_names(tmp_path, name, n):
    m = prepare_data(f"sklearn:{name}", str(tmp_path))
    assert sum(m.rows(s) for s in m.splits) == n
    assert all(f.replace("_", "").isalnum() and f == f.lower() for f in m.features)


def _write_source(table, path, kind):
    if kind == "csv":
        import pyarrow.csv as pacsv
        pacsv.write_csv(table, str(path))
    elif kind == "parquet":
        pq.write_table(table, str(path))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in table.to_pylist()))


@pytest.mark.parametrize("kind,uri", [("csv", "file"), ("parquet", "plain"), ("jsonl", "plain")])
def test_file_sources(tmp_path, kind, uri):
    src = tmp_path / f"data.{kind}"
    table = _table()
    _write_source(table, src, kind)
    source = f"file://{src}" if uri == "file" else str(src)
    m = prepare_data(source, str(tmp_path / "out"), label="y", features=["b", "a"], split=(0.5, 0.25, 0.25),
                     rows_per_shard=7)
    assert m.features == ["b", "a"] and m.label == "y"
    assert (m.rows("train"), m.rows("val"), m.rows("test")) == (20, 10, 10)
    validate_shards(load_manifest(str(tmp_path / "out")), ("train", "val", "test"))
    got = ShardReader(m).read_split("train")
    assert list(got) == ["b", "a", "y"]
    # Every training row is one of the source's rows, with its values intact.
    src_rows = {(r["b"], round(r["a"], 9), r["y"]) for r in table.to_pylist()}
    assert all((b, round(a, 9), y) in src_rows for b, a, y in zip(got["b"], got["a"], got["y"]))


def test_zero_fraction_split_is_empty_and_loads(tmp_path):
    m = prepare_data("sklearn:iris", str(tmp_path), split=(0.9, 0.1, 0.0))
    assert load_manifest(str(tmp_path)).splits["test"] == [] and m.rows("test") == 0
    assert ShardReader(m).read_split("test")["label"].shape == (0,)


def test_rerun_removes_stale_shards(tmp_path):
    prepare_data("sklearn:digits", str(tmp_path), rows_per_shard=100)
    m = prepare_data("sklearn:digits", str(tmp_path), rows_per_shard=1000)
    assert sorted(p.name for p in (tmp_path / "train").iterdir()) == ["part-00000.parquet", "part-00001.parquet"]
    assert len(m.splits["train"]) == 2


# --- reading ----------------------------------------------------------------------------------

def test_read_range_crossing_row_groups(digits):
    reader = ShardReader(digits)
    full = pq.read_table(digits.shard_uri("train", 0))
    got = reader.read("train", 0, 50, 30)  # rows 50..79 straddle row groups 0 and 1
    for column in digits.schema:
        np.testing.assert_array_equal(got[column], full.column(column).to_numpy()[50:80])
    x, y = default_feed(got, digits.features, digits.label)
    assert x.shape == (30, 64) and x.dtype == np.float32
    np.testing.assert_array_equal(y, got["label"])
    assert {k: len(v) for k, v in reader.read("train", 0, 10, 0).items()}["label"] == 0


def test_read_touches_only_overlapping_row_groups(digits, monkeypatch):
    calls = []
    original = pq.ParquetFile.read_row_groups

    def spy(self, row_groups, *args, **kwargs):
        calls.append(list(row_groups))
        return original(self, row_groups, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_groups", spy)
    reader = ShardReader(digits)
    reader.read("train", 0, 50, 30)
    reader.read("train", 0, 128, 64)  # exactly row group 2
    reader.read("train", 1, 299, 1)  # the last row of a 300-row shard
    assert calls == [[0, 1], [2], [4]]  # the groups a read lacks, in one call
    assert len(reader._files) == 2  # footers are cached per shard
    calls.clear()
    again = reader.read("train", 0, 60, 80)  # row groups 0..2, all decoded already
    assert calls == [] and len(again["label"]) == 80
    small = ShardReader(digits, cache_bytes=1)  # a cache too small keeps nothing
    small.read("train", 0, 0, 10)
    small.read("train", 0, 0, 10)
    assert calls == [[0], [0]]


def test_read_split_matches_shards(digits):
    got = ShardReader(digits).read_split("val")
    assert len(got["label"]) == 180
    full = pq.read_table(digits.shard_uri("val", 0))
    np.testing.assert_array_equal(got["pixel_3"], full.column("pixel_3").to_numpy())


def test_out_of_range_read_names_shard(digits):
    with pytest.raises(DataError, match=r"part-00000.parquet.*300 rows"):
        ShardReader(digits).read("train", 0, 290, 20)
    with pytest.raises(DataError, match="shard 9 of split 'train'"):
        ShardReader(digits).read("train", 9, 0, 1)


# --- errors -----------------------------------------------------------------------------------

def _copy(digits, tmp_path):
    import shutil

    shutil.copytree(digits.root, tmp_path / "copy")
    return tmp_path / "copy"


def test_missing_manifest(tmp_path):
    with pytest.raises(DataError, match=rf"manifest not found: {tmp_path}.*prepare-data"):
        load_manifest(str(tmp_path))


@pytest.mark.parametrize("text,why", [
    ("{\"version\": 1, \"label\"", "not valid JSON"),
    ("[1, 2]", "not a JSON object"),
    (json.dumps({"version": 1}), "missing key 'source'"),
])
def test_corrupt_manifest(tmp_path, text, why):
    (tmp_path / MANIFEST_NAME).write_text(text)
    with pytest.raises(DataError, match=rf"corrupt manifest {tmp_path}.*{why}"):
        load_manifest(str(tmp_path))


def test_manifest_wrong_types_and_empty_train(digits, tmp_path):
    folder = _copy(digits, tmp_path)
    raw = digits.to_json()
    for change, why in [({"features": "pixel_0"}, "'features' should be a list"),
                        ({"splits": {**raw["splits"], "train": []}}, "split 'train' has zero shards")]:
        (folder / MANIFEST_NAME).write_text(json.dumps({**raw, **change}))
        with pytest.raises(DataError, match=why):
            load_manifest(str(folder))


def test_missing_shard(digits, tmp_path):
    folder = _copy(digits, tmp_path)
    (folder / "train" / "part-00001.parquet").unlink()
    with pytest.raises(DataError, match=r"shard not found: .*copy/train/part-00001.parquet"):
        validate_shards(load_manifest(str(folder)))


def test_shard_schema_and_row_mismatch(digits, tmp_path):
    folder = _copy(digits, tmp_path)
    shard = folder / "train" / "part-00000.parquet"
    table = pq.read_table(shard)
    pq.write_table(table.set_column(0, "pixel_0", table.column("pixel_0").cast(pa.float64())), shard)
    with pytest.raises(DataError, match=r"part-00000.parquet column 'pixel_0' has type float64.*expects float32"):
        validate_shards(load_manifest(str(folder)))
    pq.write_table(table.slice(0, 10), shard)
    with pytest.raises(DataError, match=r"part-00000.parquet has 10 rows, the manifest says 300"):
        validate_shards(load_manifest(str(folder)))
    pq.write_table(table.drop_columns(["label"]), shard)
    with pytest.raises(DataError, match=r"part-00000.parquet lacks column 'label'"):
        validate_shards(load_manifest(str(folder)))


def test_unknown_dataset(tmp_path):
    with pytest.raises(DataError, match=r"sklearn:mnist.*sklearn:digits, sklearn:iris, sklearn:wine"):
        prepare_data("sklearn:mnist", str(tmp_path))


def test_missing_and_unsupported_files(tmp_path):
    missing = tmp_path / "nope.csv"
    with pytest.raises(DataError, match=rf"source not found: {missing}"):
        prepare_data(str(missing), str(tmp_path / "out"))
    with pytest.raises(DataError, match=r"data.xlsx.*\.csv, \.parquet, \.jsonl"):
        prepare_data(str(tmp_path / "data.xlsx"), str(tmp_path / "out"))
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(DataError, match=rf"cannot read {bad} as parquet"):
        prepare_data(str(bad), str(tmp_path / "out"))


@pytest.mark.parametrize("split", [(0.8, 0.1), (0.8, 0.3, 0.1), (1.2, -0.1, -0.1), (0.0, 0.5, 0.5),
                                   (float("nan"), 0.5, 0.5)])
def test_bad_split(tmp_path, split):
    with pytest.raises(ConfigError, match="split"):
        prepare_data("sklearn:iris", str(tmp_path), split=split)


def test_empty_split(tmp_path):
    src = tmp_path / "tiny.csv"
    src.write_text("x,label\n1,0\n2,1\n3,0\n4,1\n5,0\n")
    with pytest.raises(DataError, match=r"split 'val' would get 0 of 5 rows.*more data"):
        prepare_data(str(src), str(tmp_path / "out"))
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()


def test_missing_label_and_features(tmp_path):
    src = tmp_path / "data.csv"
    import pyarrow.csv as pacsv
    pacsv.write_csv(_table(), str(src))
    with pytest.raises(DataError, match=r"label column 'label' is not in .*data.csv.*a, b, name, y"):
        prepare_data(str(src), str(tmp_path / "out"))
    with pytest.raises(DataError, match=r"feature column 'zz' is not in"):
        prepare_data(str(src), str(tmp_path / "out"), label="y", features=["a", "zz"])
    with pytest.raises(DataError, match=r"feature column 'name' .* not a number"):
        prepare_data(str(src), str(tmp_path / "out"), label="y")


def test_manifest_roundtrip_excludes_root(digits):
    raw = digits.to_json()
    assert "root" not in raw and raw["version"] == 1
    assert isinstance(digits, Manifest)


def test_fsspec_uris_round_trip(tmp_path):
    """Non-local roots keep their protocol (memory:// stands in for s3:// and gs:// here)."""
    import gzip

    src = tmp_path / "data.csv.gz"
    src.write_bytes(gzip.compress(b"a,label\n" + b"".join(b"%d,%d\n" % (i, i % 2) for i in range(20))))
    out = f"memory://{tmp_path.name}/ds"
    m = prepare_data(f"file://{src}", out, split=(0.5, 0.5, 0.0), row_group_rows=4)
    loaded = load_manifest(out)
    assert loaded.root == f"memory:///{tmp_path.name}/ds" and loaded.shard_uri("train", 0).startswith("memory://")
    validate_shards(loaded, ("train", "val"))
    np.testing.assert_array_equal(ShardReader(loaded).read("train", 0, 3, 6)["a"],
                                  ShardReader(m).read_split("train")["a"][3:9])
