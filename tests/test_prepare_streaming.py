"""`prepare-data` streams: a source larger than its memory budget is shuffled through local spill
files, every row lands in exactly one shard, a seed gives the same output, memory stays bounded,
and a source that is not what its name says fails with one line and leaves no manifest."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from elastic_step.data.manifest import load_manifest
from elastic_step.data.prepare import prepare_data
from elastic_step.data.reader import ShardReader

ROWS = 20_000


@pytest.fixture
def ids_csv(tmp_path) -> str:
    """A CSV whose `id` column numbers the rows in source order, and a label that is id mod 3."""
    ids = np.arange(ROWS, dtype=np.int64)
    path = tmp_path / "ids.csv"
    pacsv.write_csv(pa.table({"id": ids, "x": ids * 0.5, "y": ids % 3}), str(path))
    return str(path)


def _ids_by_split(out: str) -> dict[str, np.ndarray]:
    manifest = load_manifest(out)
    reader = ShardReader(manifest)
    return {name: reader.read_split(name, columns=["id"])["id"] for name in manifest.splits}


def test_a_source_larger_than_memory_is_shuffled_through_spill_files_with_every_row_once(ids_csv, tmp_path, monkeypatch):
    spill_root = tmp_path / "tmp"
    spill_root.mkdir()
    monkeypatch.setenv("TMPDIR", str(spill_root))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    # ~480 kB of Arrow data against a 40 kB budget: about a dozen buckets.
    manifest = prepare_data(ids_csv, str(tmp_path / "out"), label="y", rows_per_shard=1000, memory_bytes=40_000,
                            seed=7)
    assert [manifest.rows(s) for s in ("train", "val", "test")] == [16_000, 2_000, 2_000]
    ids = _ids_by_split(str(tmp_path / "out"))
    every = np.concatenate([ids["train"], ids["val"], ids["test"]])
    assert np.array_equal(np.sort(every), np.arange(ROWS)), "a row was lost or written twice"
    # Shuffled: the validation rows come from all over the source, not from one end of it.
    deciles = np.bincount(ids["val"] * 10 // ROWS, minlength=10)
    assert deciles.min() > 120 and deciles.max() < 280, deciles
    assert not np.array_equal(ids["train"][:100], np.sort(ids["train"][:100]))
    assert os.listdir(spill_root) == [], "spill files left behind"

    again = prepare_data(ids_csv, str(tmp_path / "again"), label="y", rows_per_shard=1000, memory_bytes=40_000, seed=7)
    other = prepare_data(ids_csv, str(tmp_path / "other"), label="y", rows_per_shard=1000, memory_bytes=40_000, seed=8)
    assert again.content_hash == manifest.content_hash
    assert other.content_hash != manifest.content_hash


def test_a_source_that_fits_in_memory_is_one_global_permutation_as_before(ids_csv, tmp_path):
    """Within the budget nothing spills and the order is exactly `take(permutation(n))` of the
    seed, so datasets prepared before streaming existed come out byte for byte the same."""
    prepare_data(ids_csv, str(tmp_path / "out"), label="y", rows_per_shard=1000, seed=3)
    ids = _ids_by_split(str(tmp_path / "out"))
    expected = np.random.default_rng(3).permutation(ROWS)
    assert np.array_equal(np.concatenate([ids["train"], ids["val"], ids["test"]]), expected)


@pytest.mark.parametrize("fmt", ["csv.gz", "jsonl", "jsonl.bz2", "parquet"])
def test_every_format_streams_to_the_same_rows(ids_csv, tmp_path, fmt):
    table = pacsv.read_csv(ids_csv)
    path = tmp_path / f"src.{fmt}"
    if fmt == "parquet":
        pq.write_table(table, str(path), row_group_size=3000)
    else:
        text = "".join(json.dumps(r) + "\n" for r in table.to_pylist()) if fmt.startswith("jsonl") \
            else open(ids_csv).read()
        opener = {"gz": gzip.open, "bz2": __import__("bz2").open}.get(fmt.rsplit(".", 1)[-1], open)
        with opener(path, "wt") as f:
            f.write(text)
    prepare_data(str(path), str(tmp_path / "out"), label="y", rows_per_shard=4000, memory_bytes=100_000, seed=1)
    every = np.concatenate(list(_ids_by_split(str(tmp_path / "out")).values()))
    assert np.array_equal(np.sort(every), np.arange(ROWS))


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "elastic_step.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_peak_memory_stays_bounded_on_a_source_many_times_the_budget(tmp_path):
    """About 320 MB of Arrow rows prepared with a 32 MB budget: the process's peak RSS stays below
    the rows' own size (reading the whole table, then permuting it, needed more than twice it)."""
    rng = np.random.default_rng(0)
    rows = 2_000_000
    columns = {f"f{i}": rng.integers(0, 100, rows) for i in range(20)}
    columns["label"] = rng.integers(0, 10, rows)
    table = pa.table(columns)
    source = tmp_path / "big.csv"
    pacsv.write_csv(table, str(source))
    arrow_mb = table.nbytes / 2**20
    del table, columns
    out = tmp_path / "out"
    # VmHWM is this process's own peak (ru_maxrss would carry the forking test's peak over exec).
    code = ("import sys; from elastic_step.cli import main; rc = main(sys.argv[1:]); "
            "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]; "
            "print('peak_mb', int(hwm.split()[1]) / 1024); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, "prepare-data", "--source", str(source), "--out", str(out),
                           "--rows-per-shard", "100000", "--row-group-rows", "4096", "--memory-mb", "32"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    peak = float(done.stdout.split("peak_mb")[1])
    assert arrow_mb > 300
    assert peak < arrow_mb + 60, f"peak RSS {peak:.0f} MB for {arrow_mb:.0f} MB of rows"
    assert load_manifest(str(out)).rows("train") == 1_600_000


@pytest.mark.parametrize("name, content, expect", [
    ("garbage.csv.gz", b"this is not gzip at all\n" * 10, "cannot read"),
    ("bad.parquet", b"PAR1 not really parquet", "cannot read"),
    ("bad.jsonl", b'{"a": 1, "y": 0}\n{"a": 2, "y": \n', "cannot read"),
])
def test_a_source_that_is_not_its_format_is_one_line_and_no_manifest(tmp_path, name, content, expect):
    source = tmp_path / name
    source.write_bytes(content)
    out = tmp_path / "out"
    done = _cli("prepare-data", "--source", str(source), "--out", str(out), "--label", "y")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and expect in lines[0] and str(source) in lines[0], done.stderr
    assert not (out / "manifest.json").exists()


def test_a_bad_row_deep_in_a_large_csv_fails_without_replacing_the_previous_output(tmp_path):
    """The error surfaces only when the streaming reader reaches the bad block; the earlier
    complete output in --out is left as it was (its manifest still points at its own shards)."""
    source = tmp_path / "data.csv"
    good = "".join(f"{i},{i % 3}\n" for i in range(400_000))
    source.write_text("x,y\n" + good + "oops,1\n")
    out = tmp_path / "out"
    assert _cli("prepare-data", "--source", "sklearn:iris", "--out", str(out)).returncode == 0
    before = load_manifest(str(out)).content_hash
    done = _cli("prepare-data", "--source", str(source), "--out", str(out), "--label", "y")
    assert done.returncode == 2 and "cannot read" in done.stderr and "oops" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert load_manifest(str(out)).content_hash == before


def test_storage_options_refuse_credentials_and_local_only_paths(tmp_path):
    done = _cli("prepare-data", "--source", "sklearn:iris", "--out", "s3://bucket/x",
                "--storage-option", "secret=abc")
    assert done.returncode == 2 and "credential" in done.stderr and "abc" not in done.stderr
    done = _cli("prepare-data", "--source", "sklearn:iris", "--out", str(tmp_path / "o"),
                "--storage-option", "anon=true")
    assert done.returncode == 2 and "local" in done.stderr


def test_buckets_that_outgrow_memory_are_shuffled_again_not_held(tmp_path):
    """A size guess far too low (here: none) makes buckets larger than memory; each is split
    again through its own spill, so no table larger than the budget is ever read back whole."""
    from elastic_step.data.shuffle import ExternalShuffle

    ids = pa.array(np.arange(50_000, dtype=np.int64))
    batch = pa.RecordBatch.from_arrays([ids], names=["id"])
    shuffle = ExternalShuffle(batch.schema, seed=4, memory_bytes=40_000, expected_bytes=0, spill_dir=str(tmp_path))
    for start in range(0, 50_000, 5_000):
        shuffle.add(batch.slice(start, 5_000))
    tables = list(shuffle.rows())
    assert max(t.nbytes for t in tables) <= 40_000
    every = np.concatenate([t.column("id").to_numpy() for t in tables])
    assert np.array_equal(np.sort(every), np.arange(50_000))
    assert not np.array_equal(every[:1000], np.sort(every[:1000]))
    assert os.listdir(tmp_path) == []


def test_the_read_ahead_thread_hands_on_errors_and_stops_when_the_consumer_does():
    from elastic_step.data.pipelining import ahead

    def failing():
        yield 1
        raise ValueError("bad block")

    items = ahead(failing())
    assert next(items) == 1
    with pytest.raises(ValueError, match="bad block"):
        next(items)

    produced = []

    def endless():
        for i in range(10**9):
            produced.append(i)
            yield i

    consumer = ahead(endless(), depth=2)
    assert [next(consumer) for _ in range(3)] == [0, 1, 2]
    consumer.close()  # the producer thread stops rather than running on
    count = len(produced)
    import time

    time.sleep(0.3)
    assert len(produced) == count <= 6
