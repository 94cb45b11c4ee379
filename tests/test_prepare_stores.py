"""`prepare-data` from and to object stores, against the S3 and GCS servers on 127.0.0.1:
every source format, compressed or not, read straight from the store and prepared into the
store, the same rows as the same file prepared locally; and the store's failures as one line,
exit 2 and no manifest."""

import gzip
import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from test_object_stores import BUCKET, gcs, gcs_server, s3, s3_server  # noqa: F401 (fixtures)

from conftest import cli

from elastic_step.data import stores
from elastic_step.data.manifest import load_manifest
from elastic_step.data.reader import ShardReader

ROWS = 3_000


def _table() -> pa.Table:
    ids = np.arange(ROWS, dtype=np.int64)
    return pa.table({"id": ids, "x": (ids % 17).astype(np.float64), "y": ids % 3})


def _encode(fmt: str) -> bytes:
    table = _table()
    if fmt == "parquet":
        sink = io.BytesIO()
        pq.write_table(table, sink)
        return sink.getvalue()
    if fmt.startswith("jsonl"):
        text = "".join(json.dumps(r) + "\n" for r in table.to_pylist()).encode()
    else:
        sink = io.BytesIO()
        pacsv.write_csv(table, sink)
        text = sink.getvalue()
    return gzip.compress(text) if fmt.endswith(".gz") else text


def _rows(uri: str) -> dict[str, np.ndarray]:
    manifest = load_manifest(uri)
    reader = ShardReader(manifest)
    return {name: reader.read_split(name, columns=["id"])["id"] for name in manifest.splits}


@pytest.mark.parametrize("fmt", ["csv", "csv.gz", "parquet", "jsonl", "jsonl.gz"])
def test_prepare_from_s3_into_s3_gives_the_rows_a_local_prepare_gives(s3, tmp_path, fmt):
    data = _encode(fmt)
    fs = stores.resolve(f"s3://{BUCKET}")[0]
    fs.pipe_file(f"{BUCKET}/raw/{fmt}/source.{fmt}", data)
    (tmp_path / f"source.{fmt}").write_bytes(data)
    out = f"s3://{BUCKET}/prepared/{fmt}"
    done = cli("prepare-data", "--source", f"s3://{BUCKET}/raw/{fmt}/source.{fmt}", "--out", out, "--label", "y",
               "--rows-per-shard", "500")
    assert done.returncode == 0, done.stderr
    assert cli("prepare-data", "--source", str(tmp_path / f"source.{fmt}"), "--out", str(tmp_path / "local"),
               "--label", "y", "--rows-per-shard", "500").returncode == 0
    remote, local = _rows(out), _rows(str(tmp_path / "local"))
    assert all(np.array_equal(remote[s], local[s]) for s in ("train", "val", "test"))
    assert load_manifest(out).content_hash == load_manifest(str(tmp_path / "local")).content_hash
    assert sorted(np.concatenate(list(remote.values())).tolist()) == list(range(ROWS))
    assert not [p for p in fs.find(f"{BUCKET}/prepared/{fmt}") if ".tmp-" in p], "temporary objects left"


def test_prepare_from_gcs_into_gcs(gcs, tmp_path):
    fs = stores.resolve(f"gs://{BUCKET}")[0]
    fs.pipe_file(f"{BUCKET}/raw/source.csv.gz", _encode("csv.gz"))
    out = f"gs://{BUCKET}/prepared/csv"
    done = cli("prepare-data", "--source", f"gs://{BUCKET}/raw/source.csv.gz", "--out", out, "--label", "y")
    assert done.returncode == 0, done.stderr
    assert sorted(np.concatenate(list(_rows(out).values())).tolist()) == list(range(ROWS))


def _fails_in_one_line(done, *needles) -> str:
    assert done.returncode == 2, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_store_failures_are_one_line_and_leave_no_manifest(s3, monkeypatch):
    fs = stores.resolve(f"s3://{BUCKET}")[0]
    fs.pipe_file(f"{BUCKET}/raw/not-really.csv.gz", b"plain text, not gzip\n" * 20)
    fs.pipe_file(f"{BUCKET}/raw/ok.csv", _encode("csv"))
    out = f"s3://{BUCKET}/prepared/failures"

    _fails_in_one_line(cli("prepare-data", "--source", f"s3://{BUCKET}/raw/missing.csv", "--out", out),
                       f"s3://{BUCKET}/raw/missing.csv", "not found")
    _fails_in_one_line(cli("prepare-data", "--source", "s3://no-such-bucket-here/raw.csv", "--out", out),
                       "no-such-bucket-here")
    _fails_in_one_line(cli("prepare-data", "--source", f"s3://{BUCKET}/raw/not-really.csv.gz", "--out", out,
                           "--label", "y"), f"s3://{BUCKET}/raw/not-really.csv.gz", "cannot read")
    # The output's bucket does not exist: the rows were read, the writing fails, nothing is claimed.
    _fails_in_one_line(cli("prepare-data", "--source", f"s3://{BUCKET}/raw/ok.csv", "--out",
                           "s3://no-such-output-bucket/prepared", "--label", "y"), "no-such-output-bucket")
    assert not fs.exists(f"{out}/manifest.json".replace("s3://", ""))

    # An endpoint nobody listens on: named, with what to check, and no secret in the message.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    line = _fails_in_one_line(cli("prepare-data", "--source", f"s3://{BUCKET}/raw/ok.csv", "--out", out,
                                  "--label", "y"), f"s3://{BUCKET}/raw/ok.csv", "AWS_ENDPOINT_URL")
    assert s3.env()["AWS_SECRET_ACCESS_KEY"] not in line
