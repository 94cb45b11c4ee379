"""`prepare-data`: turn a dataset (a bundled sklearn one, or a CSV / Parquet / JSONL file at any
fsspec URI) into shuffled train/val/test splits of Parquet shards plus a manifest.

It streams: the source is read in blocks (`sources.py`), shuffled through bounded memory and
local spill files (`shuffle.py`), and cut into shards that are written as they fill, so a file
much larger than the step's memory can be prepared. Shards are small and cut into small row
groups so a worker can read one task's row range without reading the whole shard. The manifest
is written last, so an interrupted run never leaves an output that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import numbers
import posixpath
import uuid
from contextlib import contextmanager

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from elastic_step import defaults
from elastic_step.data.categorical_analysis import Analysis, move_large_vocabularies
from elastic_step.data.categorical_spec import (VOCABULARY_FOLDER, CategoricalSpec, check_specs, is_number, is_text,
                                                parse_buckets, parse_categorical)
from elastic_step.data.manifest import MANIFEST_NAME, Manifest, ShardInfo, type_name
from elastic_step.data.pipelining import ahead
from elastic_step.data.shuffle import DEFAULT_MEMORY_BYTES, ExternalShuffle
from elastic_step.data.sources import SKLEARN_DATASETS, SourceStream, open_source  # noqa: F401 (re-exported)
from elastic_step.data.stores import resolve, store_error
from elastic_step.errors import ConfigError, DataError

SPLITS = ("train", "val", "test")

def _select_columns(schema: pa.Schema, source: str, label: str, features: list[str] | None,
                    specs: dict[str, CategoricalSpec], auto: bool) -> list[str]:
    """The columns to keep, features first and the label last, checked against the source's schema:
    numbers as they are, and strings (or integers) that a categorical spec turns into ids."""
    found = schema.names
    if label not in found:
        raise DataError(f"label column {label!r} is not in {source}; its columns are: {', '.join(found)} — "
                        "pass --label with one of them")
    if features is None:
        features = [c for c in found if c != label]
    if not features:
        raise DataError(f"{source} has no columns besides the label {label!r}: nothing to train on")
    if label in features:
        raise ConfigError(f"--features includes the label column {label!r}; leave it out")
    if len(set(features)) != len(features):
        raise ConfigError(f"--features {','.join(features)} names a column twice")
    check_specs(specs, schema, features, label, source)
    for name in features:
        if name not in found:
            raise DataError(f"feature column {name!r} is not in {source}; its columns are: {', '.join(found)}")
        kind = schema.field(name).type
        if name in specs or is_number(kind) or (auto and is_text(kind)):
            continue
        if is_text(kind):
            raise DataError(f"feature column {name!r} of {source} has type {kind}, not a number, and no categorical "
                            f"spec — pass --categorical {name}=vocab (or {name}=hash:BINS, or auto to infer one), "
                            "or leave it out with --features")
        raise DataError(f"feature column {name!r} of {source} has type {kind}, not a number — "
                        "leave it out with --features or encode it as numbers first")
    return [*features, label]


def _split_sizes(n: int, split) -> list[int]:
    fractions = list(split) if isinstance(split, (list, tuple)) else []
    if len(fractions) != 3 or not all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in fractions):
        raise ConfigError(f"split {split!r} must be three fractions TRAIN,VAL,TEST like 0.8,0.1,0.1")
    # `not (a <= b)` rather than `a > b` so that NaN is rejected too.
    if not all(x >= 0 for x in fractions) or not abs(sum(fractions) - 1) <= 1e-6:
        raise ConfigError(f"split {split!r} must be three fractions >= 0 that sum to 1, like 0.8,0.1,0.1")
    if fractions[0] == 0:
        raise ConfigError(f"split {split!r} gives training no rows; make the first fraction > 0")
    n_val, n_test = round(n * fractions[1]), round(n * fractions[2])
    sizes = [n - n_val - n_test, n_val, n_test]
    for name, fraction, size in zip(SPLITS, fractions, sizes):
        if fraction > 0 and size <= 0:
            raise DataError(f"split {name!r} would get {max(size, 0)} of {n} rows with fractions {tuple(fractions)} — "
                            "use more data or larger fractions for it")
    return sizes


def _write_atomic(fs, path: str, data: bytes) -> None:
    """Readers see the old file or the whole new one (see `_atomic_open`)."""
    with _atomic_open(fs, path) as f:
        f.write(data)


@contextmanager
def _atomic_open(fs, path: str):
    """A file to write that appears at `path` only once complete. An object store's upload is
    atomic already (the object exists once the upload completes); a local file is written under
    a temporary name, then renamed."""
    if not isinstance(fs, LocalFileSystem):
        with fs.open(path, "wb") as f:
            yield f
        return
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with fs.open(tmp, "wb") as f:
            yield f
        fs.mv(tmp, path)
    finally:
        if fs.exists(tmp):
            fs.rm(tmp)


def _makedirs(fs, path: str) -> None:
    """Folders exist on a local disk only. An object store has keys, and s3fs's makedirs would
    create a missing bucket: a typo in --out must fail, not make a bucket in the user's account."""
    if isinstance(fs, LocalFileSystem):
        fs.makedirs(path, exist_ok=True)


WRITE_BUFFER_BYTES = 4 << 20


class _HashingFile:
    """Passes writes through to `target` and into a running hash, so a shard is encoded once,
    straight to its destination, and hashed without keeping its bytes."""

    def __init__(self, target, digest):
        self.target, self.digest, self.closed = target, digest, False
        self.written = 0

    def write(self, data) -> int:
        self.digest.update(data)
        self.written += len(data)
        return self.target.write(data)

    def flush(self) -> None:
        self.target.flush()

    def close(self) -> None:
        self.closed = True  # the target is closed by its own context


def parse_split(text) -> tuple[float, ...]:
    """`"0.8,0.1,0.1"` (or a sequence) → TRAIN,VAL,TEST fractions."""
    if not isinstance(text, str):
        return tuple(float(x) for x in text)
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--split {text!r} is not three comma-separated fractions like 0.8,0.1,0.1") from None


class ShardWriter:
    """Takes the shuffled rows in order and cuts them into the splits' shards, writing each shard
    as soon as it is full (or its split ends) and hashing the bytes in manifest order."""

    def __init__(self, fs, root_path: str, sizes: list[int], rows_per_shard: int, row_group_rows: int,
                 on_train_shard=None):
        self.fs, self.root_path = fs, root_path
        self.on_train_shard = on_train_shard  # sees each training shard's rows: the analysis pass
        self.rows_per_shard, self.row_group_rows = rows_per_shard, row_group_rows
        self.digest = hashlib.sha256()
        self.splits: dict[str, list[ShardInfo]] = {name: [] for name in SPLITS}
        self._left = list(sizes)  # rows each split still needs
        self._split = 0
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self.rows_written = 0
        self._skip_empty_splits()

    def _skip_empty_splits(self) -> None:
        while self._split < len(SPLITS) and self._left[self._split] == 0:
            self._split += 1

    def feed(self, table: pa.Table) -> None:
        offset = 0
        while offset < table.num_rows:
            if self._split >= len(SPLITS):
                raise AssertionError("more rows than the split sizes add up to")  # a bug, not bad input
            room = min(self._left[self._split], self.rows_per_shard - self._pending_rows)
            take = min(room, table.num_rows - offset)
            self._pending.append(table.slice(offset, take))
            self._pending_rows += take
            self._left[self._split] -= take
            offset += take
            if self._pending_rows == self.rows_per_shard or self._left[self._split] == 0:
                self._flush()
                if self._left[self._split] == 0:
                    self._split += 1
                    self._skip_empty_splits()

    def _flush(self) -> None:
        name = SPLITS[self._split]
        rel = f"{name}/part-{len(self.splits[name]):05d}.parquet"
        if not self.splits[name]:
            _makedirs(self.fs, posixpath.join(self.root_path, name))
        table = pa.concat_tables(self._pending)
        if name == "train" and self.on_train_shard is not None:
            self.on_train_shard(table)
        with _atomic_open(self.fs, posixpath.join(self.root_path, rel)) as f:
            # Parquet's encoder writes in pieces of a few bytes; buffered in Arrow, each Python
            # call (hash, file) takes megabytes instead (millions of calls per GB otherwise).
            hashing = _HashingFile(f, self.digest)
            sink = pa.BufferedOutputStream(pa.PythonFile(hashing, mode="w"), WRITE_BUFFER_BYTES)
            pq.write_table(table, sink, row_group_size=self.row_group_rows)
            sink.close()
        del table
        self.splits[name].append(ShardInfo(path=rel, rows=self._pending_rows, bytes=hashing.written))
        self.rows_written += self._pending_rows
        self._pending, self._pending_rows = [], 0


@contextmanager
def _progress(enabled: bool):
    """A rich progress bar on stderr (bytes read, then rows written), or nothing."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    amount = TextColumn("{task.completed:,.0f}/{task.total:,.0f} {task.fields[unit]}")
    with Progress(TextColumn("{task.description:<14}"), BarColumn(), amount, TimeRemainingColumn(),
                  console=Console(stderr=True), transient=False) as bar:
        yield bar


def prepare_data(source: str, out_dir: str, label: str = defaults.LABEL, features: list[str] | None = None,
                 split=parse_split(defaults.SPLIT), rows_per_shard: int = defaults.ROWS_PER_SHARD, seed: int = defaults.SEED,
                 row_group_rows: int = 64, memory_bytes: int = DEFAULT_MEMORY_BYTES,
                 progress: bool = False, categorical=None, buckets=None) -> Manifest:
    """Read `source`, shuffle it with `seed`, split it and write shards + manifest.json to `out_dir`.

    `categorical` and `buckets` are --categorical and --buckets specs (a string of `;`-separated
    entries, or a list of them; see categorical_spec): their columns are kept as they are, and the
    manifest records how they become ids, from the training split's vocabularies and quantiles.

    Memory stays near `memory_bytes` (plus one shard) whatever the source's size; larger sources
    spill to a local temporary folder (TMPDIR) about as large as their Arrow form, compressed."""
    for name, value in (("rows_per_shard", rows_per_shard), ("row_group_rows", row_group_rows),
                        ("memory_bytes", memory_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    _split_sizes(1_000_000, split)  # bad fractions fail before any byte is read
    specs, auto = _parse_specs(categorical, buckets)
    stream = open_source(source)
    columns = _select_columns(stream.schema, source, label, features, specs, auto)
    schema = pa.schema([stream.schema.field(c) for c in columns])
    analysis = Analysis(specs, [c for c in columns[:-1] if auto and c not in specs and is_text(schema.field(c).type)])

    shuffle = ExternalShuffle(schema, seed, memory_bytes, stream.arrow_bytes_guess)
    try:
        with _progress(progress) as bar:
            _read_all(stream, columns, shuffle, bar)
            n = shuffle.rows_added
            if n == 0:
                raise DataError(f"source {source} has no rows")
            sizes = _split_sizes(n, split)
            fs, root_path, root = resolve(out_dir)
            try:
                written = _write_shards(fs, root_path, shuffle, sizes, rows_per_shard, row_group_rows, bar, analysis)
                specs = _record_specs(fs, root_path, analysis)
            except (DataError, ConfigError):
                raise
            except Exception as exc:  # the store refused a write: say which and why, in one line
                raise store_error(out_dir, exc) from None
    finally:
        shuffle.close()
    manifest = Manifest(label=label, features=columns[:-1], schema={f.name: type_name(f.type) for f in schema},
                        splits=written.splits, content_hash=written.digest.hexdigest(), source=source, root=root,
                        categorical={c: specs[c] for c in columns[:-1] if c in specs})
    _write_atomic(fs, posixpath.join(root_path, MANIFEST_NAME), json.dumps(manifest.to_json(), indent=2).encode("utf-8"))
    return manifest


def _parse_specs(categorical, buckets) -> tuple[dict[str, CategoricalSpec], bool]:
    specs, auto = parse_categorical(categorical)
    for column, spec in parse_buckets(buckets).items():
        if column in specs:
            raise ConfigError(f"column {column!r} is in both --categorical and --buckets; give it one of them")
        specs[column] = spec
    return specs, auto


def _record_specs(fs, root_path: str, analysis: Analysis) -> dict[str, CategoricalSpec]:
    """The analysis's specs, with each large vocabulary written beside the manifest (and those of
    an earlier run in the same folder removed)."""
    specs = analysis.finish()
    kept: set[str] = set()

    def write(rel: str, data: bytes) -> None:
        if not kept:
            _makedirs(fs, posixpath.join(root_path, VOCABULARY_FOLDER))
        _write_atomic(fs, posixpath.join(root_path, rel), data)
        kept.add(posixpath.join(root_path, rel))

    move_large_vocabularies(specs, write)
    keep = {path.split("://", 1)[-1] for path in kept}
    for path in fs.glob(posixpath.join(root_path, VOCABULARY_FOLDER, "*.json")):
        if path.split("://", 1)[-1] not in keep:
            fs.rm(path)
    return specs


def _read_all(stream: SourceStream, columns: list[str], shuffle: ExternalShuffle, bar) -> None:
    """Pass one: every batch into the shuffle; missing values counted over the whole source."""
    nulls = dict.fromkeys(columns, 0)
    mb = 1 << 20
    task = bar.add_task("reading", total=(stream.total_bytes or 0) / mb, unit="MB") if bar else None
    for batch in ahead(stream.batches, depth=4):
        batch = batch.select(columns)
        for name in columns:
            nulls[name] += batch.column(name).null_count
        shuffle.add(batch)
        if bar:
            bar.update(task, completed=stream.bytes_read() / mb)
    for name, count in nulls.items():
        # A null would surface much later as a NaN loss or a failed cast in a worker.
        if count:
            raise DataError(f"column {name!r} of {stream.source} has {count} missing values — fill or drop them first")


def _write_shards(fs, root_path: str, shuffle: ExternalShuffle, sizes: list[int], rows_per_shard: int,
                  row_group_rows: int, bar, analysis: Analysis) -> ShardWriter:
    """Pass two: the shuffled rows into shards; the old manifest goes first, so a crash half-way
    leaves no "complete" output pointing at a mix of old and new shards."""
    _makedirs(fs, root_path)
    manifest_path = posixpath.join(root_path, MANIFEST_NAME)
    if fs.exists(manifest_path):
        fs.rm(manifest_path)
    writer = ShardWriter(fs, root_path, sizes, rows_per_shard, row_group_rows, analysis.add_train_shard)
    task = bar.add_task("writing shards", total=sum(sizes), unit="rows") if bar else None
    for table in ahead(shuffle.rows()):
        writer.feed(table)
        if bar:
            bar.update(task, completed=writer.rows_written)
    for name in SPLITS:
        _remove_stale(fs, root_path, name, {s.path for s in writer.splits[name]})
    return writer


def _remove_stale(fs, root_path: str, split: str, keep: set[str]) -> None:
    """Shards left by an earlier, larger run in the same folder would confuse anyone listing it."""
    for path in fs.glob(posixpath.join(root_path, split, "part-*.parquet*")):
        rel = f"{split}/{posixpath.basename(path)}"
        if rel not in keep:
            fs.rm(path)
