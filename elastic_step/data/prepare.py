"""`prepare-data`: turn a dataset (a bundled sklearn one, or a CSV / Parquet / JSONL file at any
fsspec URI) into shuffled train/val/test splits of Parquet shards plus a manifest.

Shards are small and cut into small row groups so a worker can read one task's row range without
reading the whole shard. The manifest is written last, by rename, so an interrupted run never
leaves an output that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import numbers
import posixpath
import re
import uuid

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq
from fsspec.utils import infer_compression

from elastic_step.data.manifest import MANIFEST_NAME, Manifest, ShardInfo, resolve, type_name
from elastic_step.errors import ConfigError, DataError

SPLITS = ("train", "val", "test")
SKLEARN_DATASETS = ("digits", "iris", "wine")
# Extension -> reader; .json is taken as JSON lines, which is what pyarrow.json reads.
READERS = {
    ".csv": lambda f: pacsv.read_csv(f),
    ".parquet": lambda f: pq.read_table(f),
    ".jsonl": lambda f: pajson.read_json(f),
    ".json": lambda f: pajson.read_json(f),
}


def _sanitize(name: str) -> str:
    """'sepal length (cm)' -> 'sepal_length_cm': names that are safe in CLIs and code."""
    return re.sub(r"[^0-9a-zA-Z]+", "_", name).strip("_").lower()


def _load_sklearn(name: str) -> pa.Table:
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


def read_source(source: str) -> pa.Table:
    """The whole source as one Arrow table."""
    if source.startswith("sklearn:"):
        return _load_sklearn(source[len("sklearn:"):])
    _, path, _ = resolve(source)
    compression = infer_compression(path)
    base = path[: path.rfind(".")] if compression else path  # x.csv.gz is read as CSV
    ext = posixpath.splitext(base)[1].lower()
    if ext not in READERS:
        raise DataError(f"cannot tell the format of {source}: extension {ext or '(none)'!r} is not one of "
                        f"{', '.join(READERS)} (optionally compressed, e.g. .csv.gz); rename the file or convert it")
    try:
        with fsspec.open(source, "rb", compression=None if ext == ".parquet" else "infer") as f:
            return READERS[ext](f)
    except FileNotFoundError:
        raise DataError(f"source not found: {source} — check the path or URI") from None
    except ImportError as e:  # e.g. gs:// without gcsfs
        raise DataError(f"cannot open {source}: {e}") from None
    except (pa.ArrowInvalid, OSError, ValueError) as e:
        raise DataError(f"cannot read {source} as {ext[1:]}: {e} — check the file is valid {ext[1:]}") from None


def _select_columns(table: pa.Table, source: str, label: str, features: list[str] | None) -> pa.Table:
    found = table.column_names
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
    for name in features:
        if name not in found:
            raise DataError(f"feature column {name!r} is not in {source}; its columns are: {', '.join(found)}")
        kind = table.schema.field(name).type
        if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)):
            raise DataError(f"feature column {name!r} of {source} has type {kind}, not a number — "
                            "leave it out with --features or encode it as numbers first")
    for name in [*features, label]:
        # A null would surface much later as a NaN loss or a failed cast in a worker.
        if table.column(name).null_count:
            raise DataError(f"column {name!r} of {source} has {table.column(name).null_count} missing values — "
                            "fill or drop them first")
    return table.select([*features, label])


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
    """Write to a temporary name, then rename: readers see the old file or the whole new one."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with fs.open(tmp, "wb") as f:
        f.write(data)
    fs.mv(tmp, path)


def parse_split(text) -> tuple[float, ...]:
    """`"0.8,0.1,0.1"` (or a sequence) → TRAIN,VAL,TEST fractions."""
    if not isinstance(text, str):
        return tuple(float(x) for x in text)
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--split {text!r} is not three comma-separated fractions like 0.8,0.1,0.1") from None


def prepare_data(source: str, out_dir: str, label: str = "label", features: list[str] | None = None,
                 split=(0.8, 0.1, 0.1), rows_per_shard: int = 512, seed: int = 0,
                 row_group_rows: int = 64) -> Manifest:
    """Read `source`, shuffle it with `seed`, split it and write shards + manifest.json to `out_dir`."""
    for name, value in (("rows_per_shard", rows_per_shard), ("row_group_rows", row_group_rows)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    table = _select_columns(read_source(source), source, label, features)
    if table.num_rows == 0:
        raise DataError(f"source {source} has no rows")
    sizes = _split_sizes(table.num_rows, split)
    # Shuffle before splitting so splits do not inherit the source's order (often sorted by class).
    table = table.take(pa.array(np.random.default_rng(seed).permutation(table.num_rows)))

    fs, root_path, root = resolve(out_dir)
    fs.makedirs(root_path, exist_ok=True)
    manifest_path = posixpath.join(root_path, MANIFEST_NAME)
    if fs.exists(manifest_path):
        # Overwriting: drop the old manifest first so a crash mid-way leaves no "complete" output
        # that points at a mix of old and new shards.
        fs.rm(manifest_path)

    digest = hashlib.sha256()
    splits: dict[str, list[ShardInfo]] = {}
    offset = 0
    for name, size in zip(SPLITS, sizes):
        part = table.slice(offset, size)
        offset += size
        fs.makedirs(posixpath.join(root_path, name), exist_ok=True)
        shards = []
        for index, start in enumerate(range(0, size, rows_per_shard)):
            rel = f"{name}/part-{index:05d}.parquet"
            buf = pa.BufferOutputStream()
            pq.write_table(part.slice(start, rows_per_shard), buf, row_group_size=row_group_rows)
            data = buf.getvalue().to_pybytes()
            digest.update(data)
            _write_atomic(fs, posixpath.join(root_path, rel), data)
            shards.append(ShardInfo(path=rel, rows=min(rows_per_shard, size - start)))
        splits[name] = shards
        _remove_stale(fs, root_path, name, {s.path for s in shards})

    features_out = table.column_names[:-1]
    manifest = Manifest(label=label, features=features_out,
                        schema={f.name: type_name(f.type) for f in table.schema},
                        splits=splits, content_hash=digest.hexdigest(), source=source, root=root)
    _write_atomic(fs, manifest_path, json.dumps(manifest.to_json(), indent=2).encode("utf-8"))
    return manifest


def _remove_stale(fs, root_path: str, split: str, keep: set[str]) -> None:
    """Shards left by an earlier, larger run in the same folder would confuse anyone listing it."""
    for path in fs.glob(posixpath.join(root_path, split, "part-*.parquet*")):
        rel = f"{split}/{posixpath.basename(path)}"
        if rel not in keep:
            fs.rm(path)


def summarize(manifest: Manifest) -> dict:
    """Rows per split, column counts and the label's class balance in train (read from the shards)."""
    from elastic_step.data.reader import ShardReader

    labels = ShardReader(manifest).read_split("train", columns=[manifest.label])[manifest.label]
    values, counts = np.unique(labels, return_counts=True)
    return {
        "source": manifest.source,
        "rows": {name: manifest.rows(name) for name in manifest.splits},
        "columns": len(manifest.schema),
        "features": len(manifest.features),
        "label": manifest.label,
        "class_balance": {v.item() if hasattr(v, "item") else v: int(c) for v, c in zip(values, counts)},
        "content_hash": manifest.content_hash,
    }
