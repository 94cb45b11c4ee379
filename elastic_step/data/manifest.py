"""The manifest of a prepared dataset: which Parquet shards make up each split, how many rows
each holds, the column schema and a content hash.

The manifest is the contract between `prepare-data`, the master (which plans tasks from the row
counts alone) and the workers (which read row ranges of shards). The master validates shard
footers against it before training, so a changed or damaged shard fails fast with a named cause
rather than as a shape error in the middle of a run.
"""

from __future__ import annotations

import json
import posixpath
from contextlib import contextmanager
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from elastic_step.data.categorical_features import remember_dataset
from elastic_step.data.categorical_spec import CategoricalSpec, spec_from_json
from elastic_step.data.stores import Failure, classify, resolve, store_error
from elastic_step.errors import DataError

__all__ = ["Manifest", "ShardInfo", "fetch_parquet", "load_manifest", "open_parquet", "resolve", "type_name", "validate_shards"]

MANIFEST_NAME = "manifest.json"
# Training needs rows; evaluation splits may be switched off with a fraction of 0.
REQUIRED_SPLITS = ("train",)
OPTIONAL_SPLITS = ("val", "test")


@dataclass
class ShardInfo:
    path: str  # relative to the manifest's folder, posix ("train/part-00000.parquet")
    rows: int
    bytes: int = 0  # the file's size; 0: not recorded (manifests written before it was)


@dataclass
class Manifest:
    label: str
    features: list[str]
    schema: dict[str, str]  # column -> arrow type name ("float32", "int64", ...)
    splits: dict[str, list[ShardInfo]]
    content_hash: str  # sha256 over the shard files' bytes, in manifest order
    source: str
    root: str = ""  # absolute folder of the manifest; set at load, never stored in the JSON
    version: int = 1
    # Column -> how its values become ids (hash bins, vocabulary, bucket boundaries); absent
    # from the JSON of a dataset without categorical columns.
    categorical: dict[str, CategoricalSpec] = field(default_factory=dict)

    MANIFEST_NAME = MANIFEST_NAME

    def _shards(self, split: str) -> list[ShardInfo]:
        if split not in self.splits:
            raise DataError(f"split {split!r} is not in the manifest at {self.root} "
                            f"(it has {', '.join(self.splits)}); use one of those")
        return self.splits[split]

    def shard_uri(self, split: str, index: int) -> str:
        shards = self._shards(split)
        if not 0 <= index < len(shards):
            raise DataError(f"shard {index} of split {split!r} does not exist in {self.root} "
                            f"(it has {len(shards)} shards)")
        # Join with "/" rather than os.path: root may be an fsspec URI such as s3://bucket/x.
        return self.root.rstrip("/") + "/" + shards[index].path

    def rows(self, split: str) -> int:
        return sum(s.rows for s in self._shards(split))

    def to_json(self) -> dict:
        return {
            "version": self.version,
            "source": self.source,
            "label": self.label,
            "features": list(self.features),
            "schema": dict(self.schema),
            "splits": {name: [{"path": s.path, "rows": s.rows, **({"bytes": s.bytes} if s.bytes else {})} for s in shards]
                       for name, shards in self.splits.items()},
            "content_hash": self.content_hash,
            **({"categorical": {c: spec.to_json() for c, spec in self.categorical.items()}} if self.categorical else {}),
        }


def type_name(t: pa.DataType) -> str:
    """Arrow's own names for floats are "float"/"double"; spell them by width, as numpy does."""
    if pa.types.is_floating(t):
        return f"float{t.bit_width}"
    return str(t)


def open_parquet(uri: str) -> pq.ParquetFile:
    """A ParquetFile for a shard URI; only the footer is read until row groups are asked for."""
    fs, path, _ = resolve(uri)
    with _shard_errors(uri):
        if isinstance(fs, LocalFileSystem):
            return pq.ParquetFile(path)
        # From a store, fetch exactly the byte ranges pyarrow asks for, coalesced into one request per
        # read (pre_buffer), not fsspec's default read-ahead blocks (50 MiB for S3 on every seek).
        return pq.ParquetFile(fs.open(path, "rb", cache_type="none"), pre_buffer=True)


def fetch_parquet(uri: str, size: int) -> pq.ParquetFile:
    """A (small) shard in a store, `size` bytes as the manifest says, read whole in one request
    as a ParquetFile over its bytes in memory. Opening it with open_parquet costs three requests
    (the object's size, its footer, its row groups), each a round trip and CPU in the client.
    The range is given because without one a client may ask for the object's size first."""
    fs, path, _ = resolve(uri)
    with _shard_errors(uri):
        data = fs.cat_file(path, start=0, end=size)
        if len(data) != size:
            raise DataError(f"shard {uri} has changed since the manifest was written (its size is not "
                            f"{size} bytes) — re-run `elastic-step prepare-data`")
        return pq.ParquetFile(pa.BufferReader(data))


@contextmanager
def _shard_errors(uri: str):
    """What opening a shard can raise, as one line naming the shard and what to do."""
    try:
        yield
    except pa.ArrowInvalid as e:
        raise DataError(f"shard {uri} is not a readable Parquet file ({e}) — re-run `elastic-step prepare-data`") from None
    except DataError:
        raise
    except Exception as e:  # what a store client raises: OSError subclasses, botocore and aiohttp errors
        kind = classify(e)
        if kind == Failure.NOT_FOUND:
            raise DataError(f"shard not found: {uri} — re-run `elastic-step prepare-data` for this dataset") from None
        if kind == Failure.OTHER and isinstance(e, OSError):
            raise DataError(f"shard {uri} is not a readable Parquet file ({e}) — re-run `elastic-step prepare-data`") from None
        raise store_error(uri, e) from None


def _manifest_file(path_or_dir: str):
    fs, path, canonical = resolve(path_or_dir)
    if not path.endswith(".json") or fs.isdir(path):
        path = posixpath.join(path, MANIFEST_NAME)
        canonical = canonical.rstrip("/") + "/" + MANIFEST_NAME
    return fs, path, canonical


def load_manifest(path_or_dir: str) -> Manifest:
    """Load manifest.json given the file or its folder (a local path or any fsspec URI)."""
    where = path_or_dir
    try:
        fs, path, where = _manifest_file(path_or_dir)
        with fs.open(path, "rb") as f:
            data = f.read()
    except DataError:
        raise
    except Exception as e:  # what a store client raises: OSError subclasses, botocore and aiohttp errors
        kind = classify(e)
        if kind == Failure.NOT_FOUND:
            raise DataError(f"manifest not found: {where} — run `elastic-step prepare-data --source ... --out DIR` "
                            "first and pass DIR (or DIR/manifest.json)") from None
        if kind == Failure.OTHER and isinstance(e, OSError):
            raise DataError(f"cannot read manifest {where}: {e}") from None
        raise store_error(where, e) from None
    try:
        raw = json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"corrupt manifest {where}: not valid JSON ({e}) — re-run `elastic-step prepare-data`") from None
    manifest = _from_json(raw, where)
    manifest.root = where.rsplit("/", 1)[0]
    for spec in manifest.categorical.values():
        spec.root = manifest.root
    # A model definition's sparse features find their specs in the dataset this process loaded.
    remember_dataset(manifest)
    return manifest


def _from_json(raw, where: str) -> Manifest:
    def bad(what: str) -> DataError:
        return DataError(f"corrupt manifest {where}: {what} — re-run `elastic-step prepare-data`")

    if not isinstance(raw, dict):
        raise bad("top level is not a JSON object")
    expected = {"version": int, "source": str, "label": str, "features": list, "schema": dict,
                "splits": dict, "content_hash": str}
    for key, kind in expected.items():
        if key not in raw:
            raise bad(f"missing key {key!r}")
        if not isinstance(raw[key], kind) or isinstance(raw[key], bool):
            raise bad(f"key {key!r} should be a {kind.__name__}, found {type(raw[key]).__name__}")
    if raw["version"] != 1:
        raise DataError(f"manifest {where} has version {raw['version']}, this elastic-step reads version 1 — "
                        "upgrade elastic-step or re-run prepare-data")
    schema = raw["schema"]
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in schema.items()):
        raise bad("'schema' must map column names to type names")
    features = raw["features"]
    if not features or not all(isinstance(f, str) for f in features):
        raise bad("'features' must be a non-empty list of column names")
    for column in [*features, raw["label"]]:
        if column not in schema:
            raise bad(f"column {column!r} is not in 'schema'")
    for name in REQUIRED_SPLITS:
        if name not in raw["splits"]:
            raise bad(f"split {name!r} is missing from 'splits'")
    splits: dict[str, list[ShardInfo]] = {}
    for name, shards in raw["splits"].items():
        if not isinstance(shards, list):
            raise bad(f"split {name!r} should be a list of shards")
        if not shards and name not in OPTIONAL_SPLITS:
            raise bad(f"split {name!r} has zero shards")
        splits[name] = [_shard(s, name, bad) for s in shards]
    return Manifest(label=raw["label"], features=list(features), schema=dict(schema), splits=splits,
                    content_hash=raw["content_hash"], source=raw["source"], version=raw["version"],
                    categorical=_categorical(raw.get("categorical", {}), features, bad))


def _categorical(raw, features: list[str], bad) -> dict[str, CategoricalSpec]:
    if not isinstance(raw, dict):
        raise bad("'categorical' must map column names to specs")
    for column in raw:
        if column not in features:
            raise bad(f"categorical column {column!r} is not among 'features'")
    return {column: spec_from_json(column, spec, bad) for column, spec in raw.items()}


def _shard(entry, split: str, bad) -> ShardInfo:
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str) \
            or not isinstance(entry.get("rows"), int) or isinstance(entry.get("rows"), bool):
        raise bad(f"a shard of split {split!r} is not {{'path': str, 'rows': int}}: {entry!r}")
    path = entry["path"]
    # Shards must stay inside the dataset folder: the manifest may come from somewhere untrusted.
    if path.startswith("/") or "://" in path or ".." in path.split("/"):
        raise bad(f"shard path {path!r} of split {split!r} is not relative to the manifest's folder")
    if entry["rows"] < 1:
        raise bad(f"shard {path!r} of split {split!r} has {entry['rows']} rows")
    size = entry.get("bytes", 0)
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise bad(f"shard {path!r} of split {split!r} has {size!r} bytes")
    return ShardInfo(path=path, rows=entry["rows"], bytes=size)


def validate_shards(manifest: Manifest, splits=("train",)) -> None:
    """Check each shard of `splits` exists and that its footer (schema, row count) matches the
    manifest, and that each vocabulary kept beside it is there, unchanged. Reads footers only,
    so it is cheap even for large datasets."""
    for spec in manifest.categorical.values():
        if spec.vocabulary_file:
            spec.load_vocabulary()
    expected = manifest.schema
    for split in splits:
        for index, info in enumerate(manifest._shards(split)):
            uri = manifest.shard_uri(split, index)
            pf = open_parquet(uri)
            found = {f.name: type_name(f.type) for f in pf.schema_arrow}
            for column, kind in expected.items():
                if column not in found:
                    raise DataError(f"shard {uri} lacks column {column!r} (expected {kind}) — "
                                    "the shard does not belong to this manifest; re-run prepare-data")
                if found[column] != kind:
                    raise DataError(f"shard {uri} column {column!r} has type {found[column]}, the manifest "
                                    f"expects {kind} — re-run prepare-data")
            extra = [c for c in found if c not in expected]
            if extra:
                raise DataError(f"shard {uri} has columns {extra} that the manifest does not list — "
                                "re-run prepare-data")
            rows = pf.metadata.num_rows
            if rows != info.rows:
                raise DataError(f"shard {uri} has {rows} rows, the manifest says {info.rows} — "
                                "the shard changed after prepare-data; re-run it")
