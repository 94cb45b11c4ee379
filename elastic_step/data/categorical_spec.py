"""What prepare-data is asked to do with categorical and bucketized columns, and what it records.

A spec is asked for on the command line (`--categorical`, `--buckets`, entries separated by `;`):

    --categorical 'site=hash:1000;device=vocab:oov=2:min=5;city'   (a bare column: a vocabulary)
    --categorical auto        (every string column without a spec: a vocabulary, or hashing when
                               it has too many distinct values; the choice is printed)
    --buckets 'age=18,30,50;income=quantiles:10'

and recorded in the manifest with what the analysis pass found (a vocabulary, boundaries), so
that every reader of the dataset turns the same value into the same id.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from dataclasses import dataclass, field

import pyarrow as pa

from elastic_step.data.categorical import Bucketize, Hashing, Lookup
from elastic_step.data.stores import resolve
from elastic_step.errors import ConfigError, DataError

AUTO = "auto"
# A vocabulary whose JSON is larger than this goes to a file beside the manifest.
INLINE_VOCABULARY_BYTES = 64 << 10
VOCABULARY_FOLDER = "vocabularies"


class Encoding(str, enum.Enum):
    """How a column's values become ids."""

    HASH = "hash"
    """id = hash64(value) mod num_bins: no analysis, any number of values, collisions possible."""
    VOCABULARY = "vocabulary"
    """id = index in the training split's values seen at least min_frequency times; others
    to num_oov_buckets buckets by hash."""
    BUCKETS = "buckets"
    """A number's bucket between boundaries (given, or the training split's quantiles)."""


@dataclass
class CategoricalSpec:
    column: str
    encoding: Encoding
    num_bins: int = 0  # hash
    salt: str | None = None  # hash; a vocabulary's out-of-vocabulary buckets
    num_oov_buckets: int = 1  # vocabulary
    min_frequency: int = 1  # vocabulary
    quantiles: int = 0  # buckets asked for by count: the analysis finds the boundaries
    boundaries: list[float] | None = None  # buckets
    vocabulary: list | None = None  # inline, or loaded from vocabulary_file
    vocabulary_file: str | None = None  # relative to the manifest's folder
    vocabulary_sha256: str | None = None
    vocabulary_size: int = 0
    inferred: bool = False  # chosen by `--categorical auto`
    root: str = field(default="", repr=False)  # the manifest's folder; set at load, never stored

    @property
    def num_ids(self) -> int:
        if self.encoding == Encoding.HASH:
            return self.num_bins
        if self.encoding == Encoding.BUCKETS:
            return len(self.boundaries or []) + 1
        size = len(self.vocabulary) if self.vocabulary is not None else self.vocabulary_size
        return size + self.num_oov_buckets

    def layer(self):
        """The numpy layer that turns this column's values into ids in [0, num_ids)."""
        if self.encoding == Encoding.HASH:
            return Hashing(self.num_bins, self.salt)
        if self.encoding == Encoding.BUCKETS:
            return Bucketize(self.boundaries or [])
        return Lookup(self.load_vocabulary(), self.num_oov_buckets, salt=self.salt)

    def load_vocabulary(self) -> list:
        """The vocabulary, read from its file beside the manifest (checked against its hash) if
        it is not inline."""
        if self.vocabulary is not None:
            return self.vocabulary
        uri = self.root.rstrip("/") + "/" + str(self.vocabulary_file)
        try:
            fs, path, _ = resolve(uri)
            with fs.open(path, "rb") as f:
                data = f.read()
        except Exception as exc:  # not found, or a store refused: one line either way
            raise DataError(f"the vocabulary of column {self.column!r} is missing from the dataset ({uri}: "
                            f"{type(exc).__name__}) — re-run `elastic-step prepare-data`") from None
        if hashlib.sha256(data).hexdigest() != self.vocabulary_sha256:
            raise DataError(f"the vocabulary of column {self.column!r} at {uri} has changed since the manifest was "
                            "written — re-run `elastic-step prepare-data`")
        values = json.loads(data.decode("utf-8"))
        if not isinstance(values, list) or len(values) != self.vocabulary_size:
            raise DataError(f"the vocabulary of column {self.column!r} at {uri} does not hold "
                            f"{self.vocabulary_size} values — re-run `elastic-step prepare-data`")
        self.vocabulary = values
        return values

    def describe(self) -> str:
        """One line for a person: what the column becomes."""
        return f"{self.column}: {self.how()} -> {self.num_ids} ids" + (" (inferred)" if self.inferred else "")

    def how(self) -> str:
        how = {Encoding.HASH: lambda: f"hashed into {self.num_bins} bins" + (f" (salt {self.salt!r})" if self.salt else ""),
               Encoding.VOCABULARY: lambda: (f"vocabulary of {self.num_ids - self.num_oov_buckets} values seen "
                                             f">= {self.min_frequency}x + {self.num_oov_buckets} out-of-vocabulary buckets"),
               Encoding.BUCKETS: lambda: f"{self.num_ids} buckets, boundaries {_short(self.boundaries or [])}"}
        return how[self.encoding]()

    def to_json(self) -> dict:
        out: dict = {"encoding": self.encoding.value}
        if self.encoding == Encoding.HASH:
            out["num_bins"] = self.num_bins
        elif self.encoding == Encoding.BUCKETS:
            out["boundaries"] = list(self.boundaries or [])
        else:
            out.update(num_oov_buckets=self.num_oov_buckets, min_frequency=self.min_frequency)
            if self.vocabulary_file:
                out.update(vocabulary_file=self.vocabulary_file, vocabulary_sha256=self.vocabulary_sha256,
                           vocabulary_size=self.vocabulary_size)
            else:
                out["vocabulary"] = list(self.vocabulary or [])
        if self.salt:
            out["salt"] = self.salt
        if self.inferred:
            out["inferred"] = True
        return out


def _short(values: list, shown: int = 6) -> str:
    text = ", ".join(f"{v:g}" for v in values[:shown])
    return f"[{text}{', ...' if len(values) > shown else ''}]"


def spec_from_json(column: str, raw, bad) -> CategoricalSpec:
    """A recorded spec, checked as untrusted input: `bad(what)` makes the error."""
    if not isinstance(raw, dict) or raw.get("encoding") not in {e.value for e in Encoding}:
        raise bad(f"categorical spec of {column!r} has no known 'encoding'")
    spec = CategoricalSpec(column, Encoding(raw["encoding"]), salt=raw.get("salt"), inferred=bool(raw.get("inferred")))
    if spec.salt is not None and not isinstance(spec.salt, str):
        raise bad(f"categorical spec of {column!r}: 'salt' must be a string")
    if spec.encoding == Encoding.HASH:
        spec.num_bins = _count(raw, "num_bins", 1, column, bad)
    elif spec.encoding == Encoding.BUCKETS:
        bounds = raw.get("boundaries")
        if not isinstance(bounds, list) or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds):
            raise bad(f"categorical spec of {column!r}: 'boundaries' must be a list of numbers")
        check_boundaries(bounds, f"the manifest's boundaries of {column!r}", DataError)
        spec.boundaries = [float(b) for b in bounds]
    else:
        spec.num_oov_buckets = _count(raw, "num_oov_buckets", 0, column, bad)
        spec.min_frequency = _count(raw, "min_frequency", 1, column, bad)
        _vocabulary_from_json(spec, raw, bad)
    return spec


def _vocabulary_from_json(spec: CategoricalSpec, raw: dict, bad) -> None:
    if "vocabulary" in raw:
        values = raw["vocabulary"]
        if not isinstance(values, list) or not all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in values):
            raise bad(f"categorical spec of {spec.column!r}: 'vocabulary' must be a list of strings or ints")
        spec.vocabulary = values
        return
    path, digest = raw.get("vocabulary_file"), raw.get("vocabulary_sha256")
    if not isinstance(path, str) or not isinstance(digest, str):
        raise DataError(f"the vocabulary of column {spec.column!r} is missing from the manifest (neither "
                        "'vocabulary' nor 'vocabulary_file') — re-run `elastic-step prepare-data`")
    # The file must stay inside the dataset's folder: the manifest may come from somewhere untrusted.
    if path.startswith("/") or "://" in path or ".." in path.split("/"):
        raise bad(f"vocabulary file {path!r} of {spec.column!r} is not relative to the manifest's folder")
    spec.vocabulary_file, spec.vocabulary_sha256 = path, digest
    spec.vocabulary_size = _count(raw, "vocabulary_size", 0, spec.column, bad)


def _count(raw: dict, key: str, least: int, column: str, bad) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise bad(f"categorical spec of {column!r}: {key!r} must be an integer >= {least}, found {value!r}")
    return value


def check_boundaries(bounds, where: str, error=ConfigError) -> None:
    values = list(bounds)
    if not all(isinstance(b, (int, float)) and math.isfinite(b) for b in values):
        raise error(f"{where}: boundaries must be finite numbers, got {values}")
    if any(a <= b for b, a in zip(values, values[1:])):
        raise error(f"{where}: boundaries {values} are not strictly increasing — list them from low to high, "
                    "each once")


def _entries(texts) -> list[str]:
    if texts is None:
        return []
    if isinstance(texts, str):
        texts = [texts]
    return [part.strip() for text in texts for part in str(text).split(";") if part.strip()]


def parse_categorical(texts) -> tuple[dict[str, CategoricalSpec], bool]:
    """(column -> spec asked for, whether `auto` was given) from --categorical values."""
    specs: dict[str, CategoricalSpec] = {}
    auto = False
    for entry in _entries(texts):
        if entry == AUTO:
            auto = True
            continue
        column, _, how = entry.partition("=")
        column = column.strip()
        spec = _parse_one_categorical(entry, column, how.strip() or "vocab")
        if column in specs:
            raise ConfigError(f"--categorical names column {column!r} twice; give it one spec")
        specs[column] = spec
    return specs, auto


def _parse_one_categorical(entry: str, column: str, how: str) -> CategoricalSpec:
    usage = "COLUMN=hash:BINS[:salt=S] or COLUMN=vocab[:oov=N][:min=F][:salt=S]"
    parts = how.split(":")
    if not column:
        raise ConfigError(f"--categorical {entry!r} names no column; use {usage}")
    first_option = 2 if parts[0] == "hash" else 1  # hash:BINS:options..., vocab:options...
    options = dict(_option(entry, p, usage) for p in parts[first_option:])
    if parts[0] == "hash":
        if len(parts) < 2:
            raise ConfigError(f"--categorical {entry!r}: hashing needs a number of bins, like {column}=hash:1000")
        spec = CategoricalSpec(column, Encoding.HASH, num_bins=_int(entry, "BINS", parts[1], 1))
        allowed = {"salt"}
    elif parts[0] in ("vocab", "vocabulary"):
        spec = CategoricalSpec(column, Encoding.VOCABULARY,
                               num_oov_buckets=_int(entry, "oov", options.get("oov", "1"), 0),
                               min_frequency=_int(entry, "min", options.get("min", "1"), 1))
        allowed = {"oov", "min", "salt"}
    else:
        raise ConfigError(f"--categorical {entry!r}: {parts[0]!r} is not an encoding; use {usage}")
    unknown = set(options) - allowed
    if unknown:
        raise ConfigError(f"--categorical {entry!r}: unknown option {sorted(unknown)[0]!r}; use {usage}")
    spec.salt = options.get("salt") or None
    return spec


def _option(entry: str, part: str, usage: str) -> tuple[str, str]:
    key, eq, value = part.partition("=")
    if not eq:
        raise ConfigError(f"--categorical {entry!r}: {part!r} is not KEY=VALUE; use {usage}")
    return key.strip(), value.strip()


def _int(entry: str, name: str, text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < least:
        raise ConfigError(f"--categorical {entry!r}: {name} must be an integer >= {least}, got {text!r}")
    return value


def parse_buckets(texts) -> dict[str, CategoricalSpec]:
    """column -> spec asked for, from --buckets values (COLUMN=B1,B2,... or COLUMN=quantiles:N)."""
    specs: dict[str, CategoricalSpec] = {}
    for entry in _entries(texts):
        column, eq, how = (s.strip() for s in entry.partition("="))
        if not column or not eq or not how:
            raise ConfigError(f"--buckets {entry!r} is not COLUMN=B1,B2,... or COLUMN=quantiles:N")
        if how.startswith("quantiles:"):
            text = how[len("quantiles:"):]
            count = int(text) if text.strip().isdigit() else 0
            if count < 2:
                raise ConfigError(f"--buckets {entry!r}: quantiles:N needs N >= 2 buckets, got {text!r}")
            spec = CategoricalSpec(column, Encoding.BUCKETS, quantiles=count)
        else:
            try:
                bounds = [float(b) for b in how.split(",")]
            except ValueError:
                raise ConfigError(f"--buckets {entry!r}: boundaries must be numbers like {column}=18,30,50") from None
            check_boundaries(bounds, f"--buckets {entry!r}")
            spec = CategoricalSpec(column, Encoding.BUCKETS, boundaries=bounds)
        if column in specs:
            raise ConfigError(f"--buckets names column {column!r} twice; give it one spec")
        specs[column] = spec
    return specs


def is_text(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def is_number(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)


def check_specs(specs: dict[str, CategoricalSpec], schema: pa.Schema, features: list[str], label: str, source: str) -> None:
    """Each spec names a feature column of a type it can encode (before any row is read)."""
    for column, spec in specs.items():
        flag = "--buckets" if spec.encoding == Encoding.BUCKETS else "--categorical"
        if column == label:
            raise ConfigError(f"{flag} names the label column {column!r}; encode feature columns only")
        if column not in schema.names:
            raise DataError(f"{flag} names column {column!r}, which is not in {source}; its columns are: "
                            f"{', '.join(schema.names)}")
        if column not in features:
            raise ConfigError(f"{flag} names column {column!r}, which --features leaves out; add it to --features")
        kind = schema.field(column).type
        if spec.encoding == Encoding.BUCKETS and not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
            raise DataError(f"--buckets names column {column!r} of {source}, of type {kind}: buckets cut numbers — "
                            "use --categorical for it instead")
        if spec.encoding != Encoding.BUCKETS and not (is_text(kind) or pa.types.is_integer(kind)):
            raise DataError(f"--categorical names column {column!r} of {source}, of type {kind}: hashing and "
                            "vocabularies take strings or integers — use --buckets COLUMN=B1,B2,... for a number")
