"""The analysis pass of prepare-data: the training split's vocabularies and quantile boundaries.

It sees the training rows as they are written, one shard at a time. Each shard's value counts
are exact and merge exactly (counts add), so the vocabulary of the whole split does not depend
on how it was cut into shards: the values seen at least `min_frequency` times, the most frequent
first, ties in value order. Only training rows count, so a value first seen in validation or
test is out of vocabulary there, as it will be in serving.

Quantile boundaries come from the first rows of the training split: prepare-data has shuffled
them uniformly, so those rows are a uniform sample of it, and the boundaries depend on the seed
alone.
"""

from __future__ import annotations

import hashlib
import json
import math
import posixpath
import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from elastic_step.data.categorical_spec import (INLINE_VOCABULARY_BYTES, VOCABULARY_FOLDER, CategoricalSpec,
                                                Encoding)
from elastic_step.errors import DataError

QUANTILE_SAMPLE_ROWS = 1_000_000
# `--categorical auto` keeps a vocabulary up to this many distinct values, and hashes beyond.
AUTO_VOCABULARY_LIMIT = 10_000
# Counting stops here for a column that `auto` will hash anyway: its counts would only cost memory.
AUTO_COUNT_LIMIT = 1_000_000


class ValueCounts:
    """Exact counts of a column's values, held as Arrow (value, count) tables and compacted by
    group-by when they grow; `merge` adds another's counts."""

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self.overflowed = False  # more than `limit` distinct values: counting stopped
        self._parts: list[pa.Table] = []
        self._rows = 0
        self._compacted_rows = 0

    def update(self, values) -> None:
        if self.overflowed:
            return
        counts = pc.value_counts(values)
        self._add(pa.table({"value": counts.field("values"), "count": counts.field("counts").cast(pa.int64())}))

    def merge(self, other: "ValueCounts") -> None:
        self.overflowed |= other.overflowed
        for part in other._parts:
            if not self.overflowed:
                self._add(part)

    def _add(self, part: pa.Table) -> None:
        self._parts.append(part)
        self._rows += part.num_rows
        if self._rows > 2 * self._compacted_rows + (1 << 16):
            self._compact()

    def _compact(self) -> pa.Table:
        if not self._parts:
            return pa.table({"value": pa.array([], pa.string()), "count": pa.array([], pa.int64())})
        table = pa.concat_tables(self._parts).group_by("value").aggregate([("count", "sum")])
        table = table.select(["value", "count_sum"]).rename_columns(["value", "count"])
        self._parts, self._rows = [table], table.num_rows
        self._compacted_rows = table.num_rows
        if self.limit is not None and table.num_rows > self.limit:
            self.overflowed, self._parts = True, []
        return table

    def distinct(self) -> int:
        return self._compact().num_rows

    def vocabulary(self, min_frequency: int = 1) -> list:
        """Values seen at least `min_frequency` times, most frequent first, ties by value."""
        table = self._compact()
        table = table.filter(pc.greater_equal(table.column("count"), min_frequency))
        table = table.sort_by([("count", "descending"), ("value", "ascending")])
        return table.column("value").to_pylist()


class Analysis:
    """Fed every training shard; `finish` completes the specs (vocabularies, quantile boundaries,
    and the choices of `auto`)."""

    def __init__(self, specs: dict[str, CategoricalSpec], auto_columns: list[str]):
        self.specs = specs
        self.auto_columns = auto_columns
        counted = [c for c, s in specs.items() if s.encoding == Encoding.VOCABULARY]
        self.counts = {c: ValueCounts() for c in counted}
        self.counts.update({c: ValueCounts(AUTO_COUNT_LIMIT) for c in auto_columns})
        self.samples: dict[str, list[np.ndarray]] = {c: [] for c, s in specs.items() if s.quantiles}
        self._sampled = 0

    def add_train_shard(self, table: pa.Table) -> None:
        for column, total in self.counts.items():
            shard = ValueCounts(total.limit)
            shard.update(table.column(column))
            total.merge(shard)
        take = min(table.num_rows, QUANTILE_SAMPLE_ROWS - self._sampled)
        if take > 0 and self.samples:
            for column, parts in self.samples.items():
                parts.append(table.column(column).slice(0, take).to_numpy().astype(np.float64))
            self._sampled += take

    def finish(self) -> dict[str, CategoricalSpec]:
        for column, spec in self.specs.items():
            if spec.encoding == Encoding.VOCABULARY:
                spec.vocabulary = self.counts[column].vocabulary(spec.min_frequency)
                if spec.num_ids == 0:
                    raise DataError(f"column {column!r}: no value of the training split is seen {spec.min_frequency} "
                                    "times and there is no out-of-vocabulary bucket — lower min or raise oov")
            elif spec.quantiles:
                spec.boundaries = _quantile_boundaries(self.samples[column], spec.quantiles)
        for column in self.auto_columns:
            self.specs[column] = _inferred(column, self.counts[column])
        return self.specs


def _quantile_boundaries(parts: list[np.ndarray], count: int) -> list[float]:
    sample = np.concatenate(parts) if parts else np.empty(0)
    sample = sample[~np.isnan(sample)]
    if sample.size == 0:
        return []
    # Boundaries at values of the sample (not between them), each once: tied values make fewer buckets.
    cuts = np.quantile(sample, np.linspace(0, 1, count + 1)[1:-1], method="inverted_cdf")
    bounds = np.unique(cuts)
    return [float(b) for b in bounds if b > sample.min()]


def _inferred(column: str, counts: ValueCounts) -> CategoricalSpec:
    distinct = AUTO_COUNT_LIMIT if counts.overflowed else counts.distinct()
    if distinct <= AUTO_VOCABULARY_LIMIT:
        return CategoricalSpec(column, Encoding.VOCABULARY, num_oov_buckets=1, vocabulary=counts.vocabulary(1),
                               inferred=True)
    bins = 1 << max(1, math.ceil(math.log2(2 * distinct)))  # a power of two, about half of it used
    return CategoricalSpec(column, Encoding.HASH, num_bins=bins, inferred=True)


def move_large_vocabularies(specs: dict[str, CategoricalSpec], write) -> None:
    """A vocabulary too large to inline goes to `vocabularies/` beside the manifest; the spec keeps
    its path, size and SHA-256. `write(relative_path, bytes)` writes one file atomically."""
    for index, (column, spec) in enumerate(specs.items()):
        if spec.encoding != Encoding.VOCABULARY:
            continue
        data = json.dumps(spec.vocabulary, ensure_ascii=False).encode("utf-8")
        if len(data) <= INLINE_VOCABULARY_BYTES:
            spec.vocabulary_file = None
            continue
        safe = re.sub(r"[^0-9A-Za-z_.-]+", "_", column)[:60]
        spec.vocabulary_file = posixpath.join(VOCABULARY_FOLDER, f"{index:03d}-{safe}.json")
        spec.vocabulary_sha256 = hashlib.sha256(data).hexdigest()
        spec.vocabulary_size = len(spec.vocabulary)
        write(spec.vocabulary_file, data)
