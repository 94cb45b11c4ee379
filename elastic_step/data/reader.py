"""Reading row ranges of prepared shards.

A worker's task is "rows [start, start+count) of shard i". Reading it touches only the row groups
that overlap the range, so a task costs roughly its own size in I/O however large the shard is.
"""

from __future__ import annotations

import collections
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from elastic_step.data.manifest import Manifest, fetch_parquet, open_parquet
from elastic_step.data.stores import is_local
from elastic_step.errors import DataError


class ShardReader:
    def __init__(self, manifest: Manifest, cache_bytes: int = 256 << 20):
        self.manifest = manifest
        # Decoded row groups, least recently used first: a worker meets the same shards every
        # epoch, and decoding Parquet again would hold the GIL its training thread needs.
        self.cache_bytes = cache_bytes
        self._cache: collections.OrderedDict[tuple, pa.Table] = collections.OrderedDict()
        self._cached = 0
        # Workers read many ranges of the same few shards: keep each footer parsed and file open.
        self._files: dict[tuple[str, int], tuple[pq.ParquetFile, np.ndarray]] = {}
        self._lock = threading.Lock()  # a ParquetFile's handle is not safe to share between threads
        # From an object store every request costs a round trip (and CPU in the client): a small
        # shard is read whole on its first miss, in one request, and its row groups cached, so
        # the shard's later tasks cost no request at all. Bounded by the cache like any read.
        self.whole_shard_bytes = 0 if is_local(manifest.root) else min(8 << 20, cache_bytes // 8)
        # Such a shard is fetched in one request and kept in memory as it came (its decoded row
        # groups go to the cache): the newest ones, up to a quarter of the cache; an older one is
        # fetched again if it is needed again.
        self._in_memory: collections.OrderedDict[tuple[str, int], int] = collections.OrderedDict()

    def _open(self, split: str, index: int) -> tuple[pq.ParquetFile, np.ndarray]:
        key = (split, index)
        if key not in self._files:
            uri = self.manifest.shard_uri(split, index)
            size = self.manifest._shards(split)[index].bytes  # 0: unknown
            if 0 < size <= self.whole_shard_bytes:
                pf = fetch_parquet(uri, size)
                self._in_memory[key] = size
                while sum(self._in_memory.values()) > self.cache_bytes // 4 and len(self._in_memory) > 1:
                    old, _ = self._in_memory.popitem(last=False)
                    self._files.pop(old, None)
            else:
                pf = open_parquet(uri)
            sizes = [pf.metadata.row_group(i).num_rows for i in range(pf.metadata.num_row_groups)]
            starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])  # row group g: [starts[g], starts[g+1])
            self._files[key] = (pf, starts)
        return self._files[key]

    def _columns(self, columns) -> list[str]:
        names = list(self.manifest.schema) if columns is None else list(columns)
        unknown = [c for c in names if c not in self.manifest.schema]
        if unknown:
            raise DataError(f"columns {unknown} are not in the dataset at {self.manifest.root}; "
                            f"it has {', '.join(self.manifest.schema)}")
        return names

    def read(self, split: str, shard_index: int, start: int, count: int, columns=None) -> dict[str, np.ndarray]:
        """Exactly rows [start, start+count) of one shard, as one numpy array per column."""
        names = self._columns(columns)
        with self._lock:
            uri = self.manifest.shard_uri(split, shard_index)
            pf, starts = self._open(split, shard_index)
            total = int(starts[-1])
            if start < 0 or count < 0 or start + count > total:
                raise DataError(f"rows [{start}, {start + count}) are outside shard {uri}, which has {total} rows "
                                "— the task plan does not match the data; re-plan the job from this manifest")
            if count == 0:
                return _to_numpy(pf.schema_arrow.empty_table().select(names))
            # Row groups g with starts[g] < end and starts[g+1] > start overlap the range.
            first = int(np.searchsorted(starts, start, side="right")) - 1
            last = int(np.searchsorted(starts, start + count, side="left")) - 1
            table = pa.concat_tables(self._row_groups(pf, split, shard_index, range(first, last + 1), starts, names))
        return _to_numpy(table.slice(start - int(starts[first]), count))

    def _row_groups(self, pf: pq.ParquetFile, split: str, shard: int, groups, starts, names: list[str]) -> list[pa.Table]:
        """The row groups, from the cache where it has them; the others in one read (from an object
        store: one coalesced request, not one per group)."""
        tables: dict[int, pa.Table] = {}
        for group in groups:
            key = (split, shard, group, tuple(names))
            if key in self._cache:
                self._cache.move_to_end(key)
                tables[group] = self._cache[key]
        missing = [g for g in groups if g not in tables]
        # A shard fetched whole is in memory already: decode only what is asked for. (Decoding
        # all of it would repeat, on every worker, the work of the others' tasks.)
        if missing and self.whole_shard_bytes and (split, shard) not in self._in_memory:
            meta = pf.metadata
            if sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups)) <= self.whole_shard_bytes:
                missing = [g for g in range(meta.num_row_groups)
                           if g not in tables and (split, shard, g, tuple(names)) not in self._cache]
        if missing:
            read = pf.read_row_groups(missing, columns=names)
            offset = 0
            for group in missing:
                rows = int(starts[group + 1] - starts[group])
                tables[group] = read.slice(offset, rows)
                offset += rows
                self._remember((split, shard, group, tuple(names)), tables[group])
        return [tables[g] for g in groups]

    def _remember(self, key: tuple, table: pa.Table) -> None:
        # nbytes of a slice counts only its own rows' share of the read's buffers
        size = table.nbytes
        if size > self.cache_bytes:
            return
        self._cache[key] = table
        self._cached += size
        while self._cached > self.cache_bytes:
            _, old = self._cache.popitem(last=False)
            self._cached -= old.nbytes

    def read_split(self, split: str, columns=None) -> dict[str, np.ndarray]:
        """Every row of a split, shards in order (for evaluation, which wants the whole split)."""
        names = self._columns(columns)
        tables = []
        with self._lock:
            for index in range(len(self.manifest._shards(split))):
                pf, _ = self._open(split, index)
                tables.append(pf.read(columns=names))
        if not tables:  # a split switched off with fraction 0
            return {n: np.empty(0, dtype=_numpy_dtype(self.manifest.schema[n])) for n in names}
        return _to_numpy(pa.concat_tables(tables))

    def close(self) -> None:
        with self._lock:
            for pf, _ in self._files.values():
                pf.close()
            self._files.clear()


def _to_numpy(table: pa.Table) -> dict[str, np.ndarray]:
    return {name: table.column(name).to_numpy() for name in table.column_names}


def _numpy_dtype(type_name: str):
    try:
        return pa.type_for_alias(type_name).to_pandas_dtype()
    except (ValueError, NotImplementedError):
        return object


def default_feed(batch: dict, features: list[str], label: str) -> tuple[np.ndarray, np.ndarray]:
    """(x float32 [n, len(features)], y) for models without their own feed(): feature columns
    stacked in manifest order, the label column as stored."""
    missing = [c for c in [*features, label] if c not in batch]
    if missing:
        raise DataError(f"batch lacks columns {missing} (it has {', '.join(batch)}) — "
                        "read it with columns=None or include them")
    x = np.column_stack([np.asarray(batch[c], dtype=np.float32) for c in features])
    return x.astype(np.float32, copy=False), batch[label]
