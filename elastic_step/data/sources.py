"""Reading a `prepare-data` source as a stream of Arrow record batches, never the whole file.

A source is a bundled scikit-learn dataset (`sklearn:digits`), a generated click log shaped like
Criteo's (`synthetic:criteo?rows=N`, data/synthetic_ctr.py), or a CSV / Parquet / JSON-lines
file at any fsspec URI, optionally compressed (`.csv.gz`, `.jsonl.zst`, ...). CSV and JSON lines
go through pyarrow's streaming readers, Parquet row group by row group, so memory stays at about
one block whatever the file's size. The stream counts the raw bytes it has consumed, which is
what a progress bar can show against the file's size.
"""

from __future__ import annotations

import gzip
import lzma
import posixpath
import re
import zlib
from dataclasses import dataclass
from typing import Callable, Iterator

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq
from fsspec.compression import compr
from fsspec.utils import infer_compression

from elastic_step.data.stores import resolve, store_error
from elastic_step.errors import DataError

SKLEARN_DATASETS = ("digits", "iris", "wine")
FORMATS = {".csv": "csv", ".parquet": "parquet", ".jsonl": "json", ".json": "json"}  # .json is read as JSON lines
# Bytes the CSV and JSON readers parse at a time. Their background reader runs about 32 blocks
# ahead of the batches taken (measured with pyarrow 25), so this also bounds the read-ahead.
BLOCK_BYTES = 1 << 20
# Arrow bytes per source byte, roughly and on the high side (numbers of a few digits become 8-byte
# values; JSON repeats its keys; compression hides a factor of 3-10). The shuffle sizes its spill
# from this guess, which depends on the file alone, never on timing.
EXPANSION = {"csv": 4, "json": 2, "parquet": 4}
COMPRESSED_EXPANSION = 20


def _sanitize(name: str) -> str:
    """'sepal length (cm)' -> 'sepal_length_cm': names that are safe in CLIs and code."""
    return re.sub(r"[^0-9a-zA-Z]+", "_", name).strip("_").lower()


def _sklearn_table(name: str) -> pa.Table:
    import sklearn.datasets as skd

    if name not in SKLEARN_DATASETS:
        raise DataError(f"unknown dataset sklearn:{name} — known: "
                        + ", ".join(f"sklearn:{n}" for n in SKLEARN_DATASETS))
    bunch = getattr(skd, f"load_{name}")()  # bundled with sklearn: no download
    if name == "digits":
        names = [f"pixel_{i}" for i in range(bunch.data.shape[1])]
    else:
        names = [_sanitize(n) for n in bunch.feature_names]
    columns = {n: pa.array(bunch.data[:, i].astype(np.float32)) for i, n in enumerate(names)}
    columns["label"] = pa.array(bunch.target.astype(np.int64))
    return pa.table(columns)


def source_format(source: str) -> tuple[str, str | None]:
    """(format, compression) from the name: `x.csv.gz` -> ("csv", "gzip")."""
    path = source.split("?", 1)[0]
    compression = infer_compression(path)
    base = path[: path.rfind(".")] if compression else path
    ext = posixpath.splitext(base)[1].lower()
    if ext not in FORMATS:
        raise DataError(f"cannot tell the format of {source}: extension {ext or '(none)'!r} is not one of "
                        f"{', '.join(FORMATS)} (optionally compressed, e.g. .csv.gz); rename the file or convert it")
    if FORMATS[ext] == "parquet" and compression:
        raise DataError(f"{source}: a Parquet file compresses its own pages; remove the outer "
                        f".{posixpath.splitext(path)[1][1:]} compression")
    return FORMATS[ext], compression


@dataclass
class SourceStream:
    """Record batches of one source, with how far through the raw bytes the stream has got."""

    source: str
    schema: pa.Schema
    batches: Iterator[pa.RecordBatch]
    total_bytes: int | None  # the raw (possibly compressed) size, where the store says it
    bytes_read: Callable[[], int]
    arrow_bytes_guess: int = 0  # what the rows may take in memory, from the file's size and format


def open_source(source: str) -> SourceStream:
    """Open `source` for streaming. Errors name the source and what to check."""
    if source.startswith("synthetic:"):
        from elastic_step.data import synthetic_ctr

        spec = synthetic_ctr.parse_source(source)
        done = [0]
        guess = spec.rows * 380  # bytes per row in Arrow: 13 floats, 26 strings of 8 characters, 2 more

        def counted():
            for batch in synthetic_ctr.blocks(spec):
                done[0] += batch.nbytes
                yield batch
        return SourceStream(source, synthetic_ctr.schema(), counted(), guess, lambda: done[0], guess)
    if source.startswith("sklearn:"):
        table = _sklearn_table(source[len("sklearn:"):])
        return SourceStream(source, table.schema, iter(table.to_batches()), table.nbytes, lambda: table.nbytes,
                            table.nbytes)
    kind, compression = source_format(source)
    fs, path, _ = resolve(source)
    try:
        total = fs.size(path)
        raw = fs.open(path, "rb")
    except FileNotFoundError:
        raise DataError(f"source not found: {source} — check the path or URI") from None
    except Exception as exc:
        raise store_error(source, exc) from None
    guess = total * (COMPRESSED_EXPANSION if compression else EXPANSION[kind])
    if kind == "parquet":
        return _parquet_stream(source, raw, total, guess)
    stream = compr[compression](raw, mode="rb") if compression else raw
    try:
        if kind == "csv":
            reader = pacsv.open_csv(stream, read_options=pacsv.ReadOptions(block_size=BLOCK_BYTES))
        else:
            reader = pajson.open_json(stream, read_options=pajson.ReadOptions(block_size=BLOCK_BYTES))
    except Exception as exc:
        raw.close()
        raise _read_error(source, kind, exc) from None
    return SourceStream(source, reader.schema, _guarded(reader, raw, source, kind), total, raw.tell, guess)


def _parquet_stream(source: str, raw, total: int, guess: int) -> SourceStream:
    try:
        pf = pq.ParquetFile(raw)
    except Exception as exc:
        raw.close()
        raise _read_error(source, "parquet", exc) from None
    return SourceStream(source, pf.schema_arrow, _guarded(pf.iter_batches(batch_size=65536), raw, source, "parquet"),
                        total, raw.tell, guess)


def _guarded(batches, raw, source: str, kind: str) -> Iterator[pa.RecordBatch]:
    """The reader's batches, with a failure half-way (a bad line, a dropped connection) named."""
    try:
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except Exception as exc:
                raise _read_error(source, kind, exc) from None
            yield batch
    finally:
        raw.close()


def _read_error(source: str, kind: str, exc: Exception) -> DataError:
    if isinstance(exc, DataError):
        return exc
    if isinstance(exc, (pa.ArrowInvalid, ValueError, EOFError, UnicodeDecodeError, gzip.BadGzipFile, zlib.error,
                        lzma.LZMAError)):
        detail = " ".join(str(exc).split())[:300]
        return DataError(f"cannot read {source} as {kind}: {detail} — check the file is valid {kind}")
    return store_error(source, exc)
