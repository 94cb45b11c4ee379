"""A uniform shuffle of a table larger than memory, in two passes over local spill files.

While the rows fit in `memory_bytes` they are kept as they are, and the shuffle is one random
permutation of the whole table — exactly what `table.take(rng.permutation(n))` gives, so small
datasets come out as they always did for a seed. Past that, every row (those held so far, then
each new batch) goes to one of B buckets chosen at random, each bucket a compressed Arrow IPC
file in a local temporary folder; the second pass reads one bucket at a time and permutes it.
Random buckets plus a random order inside each bucket treat every row alike, so every order of
the rows is equally likely — the same distribution as a global permutation, with memory bounded
by one bucket (about `memory_bytes`) instead of the table.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from typing import Iterator

import numpy as np
import pyarrow as pa

# Held rows cost their Arrow size; a bucket is read back whole and permuted (one copy more).
DEFAULT_MEMORY_BYTES = 256 << 20
# zstd rather than lz4: on columns of small numbers (int64 holding 0-99) it writes 7.4x smaller
# files at twice lz4-frame's speed (755 against 391 MB/s) and reads back nearly as fast, so
# the spill of a large source stays in the page cache instead of waiting on the disk.
_IPC_OPTIONS = pa.ipc.IpcWriteOptions(compression=pa.Codec("zstd", compression_level=1))
# The most a table with 32-bit-offset (string, binary) columns may hold: below 2 GiB of text, with
# room for the batch that takes it over the budget.
STRING_TABLE_BYTES = 3 << 29


def _permuted(table: pa.Table, rng: np.random.Generator) -> pa.Table:
    """The rows in a random order. Callers drop the unpermuted table before yielding this one, so
    a consumer running ahead holds one copy of a bucket, not two."""
    return table.take(pa.array(rng.permutation(table.num_rows)))


class ExternalShuffle:
    """add() batches in any number, then rows() yields tables whose concatenation is a uniformly
    random order of every row added.

    `expected_bytes` guesses the whole input's Arrow size, to choose how many buckets to spill
    into. The guess must depend only on the input (not on timing), so that a seed always gives
    the same order; a bucket that turns out larger than memory is shuffled the same way again,
    into buckets of its own, so a bad guess costs time, never memory."""

    def __init__(self, schema: pa.Schema, seed, memory_bytes: int = DEFAULT_MEMORY_BYTES,
                 expected_bytes: int = 0, spill_dir: str | None = None):
        self.schema = schema
        self.seed = seed
        # Arrow's take concatenates a column's chunks first, and a string column's 32-bit offsets
        # overflow past 2 GiB of text: with such columns, no table held or read back may be that large.
        if any(pa.types.is_string(f.type) or pa.types.is_binary(f.type) for f in schema):
            memory_bytes = min(memory_bytes, STRING_TABLE_BYTES)
        self.memory_bytes = memory_bytes
        self.expected_bytes = expected_bytes
        self._spill_root = spill_dir
        # The in-memory case draws exactly one permutation from this generator, as before; the
        # bucket choices come from an independent stream of the same seed.
        self._rng = np.random.default_rng(seed)
        self._bucket_rng = np.random.default_rng([*np.atleast_1d(seed), 1])
        self._held: list[pa.RecordBatch] = []
        self._held_bytes = 0
        self.rows_added = 0
        self._dir: str | None = None
        self._writers: list[pa.ipc.RecordBatchFileWriter] = []
        self._writers_open = False
        self._bucket_bytes: list[int] = []
        # Once spilling, rows are held until a chunk of this size and scattered to the buckets
        # together: the per-scatter work (a sort, a take, a write per bucket) is paid per chunk,
        # not per source block, so it does not grow with the number of buckets x blocks, and
        # each bucket's write is large enough to compress well.
        self._chunk_bytes = max(1, memory_bytes // 4)

    @property
    def spilled(self) -> bool:
        return bool(self._writers)

    @property
    def buckets(self) -> int:
        return len(self._writers) or 1

    def add(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        self.rows_added += batch.num_rows
        if self.spilled:
            self._add_to_chunk(batch)
            return
        self._held.append(batch)
        self._held_bytes += batch.nbytes
        if self._held_bytes > self.memory_bytes:
            self._start_spilling()

    def _start_spilling(self) -> None:
        # Buckets of about half the budget: reading one back and permuting it holds two copies.
        count = max(2, math.ceil(2 * max(self.expected_bytes, 2 * self._held_bytes) / self.memory_bytes))
        self._bucket_bytes = [0] * count
        self._dir = tempfile.mkdtemp(prefix="elastic-step-shuffle-", dir=self._spill_root)
        self._writers_open = True
        self._writers = [pa.ipc.new_file(os.path.join(self._dir, f"bucket-{b:05d}.arrow"), self.schema,
                                         options=_IPC_OPTIONS) for b in range(count)]
        held, self._held, self._held_bytes = self._held, [], 0
        held.reverse()
        while held:  # chunk by chunk, letting go of each batch as it is scattered
            self._add_to_chunk(held.pop())
        self._scatter()

    def _add_to_chunk(self, batch: pa.RecordBatch) -> None:
        self._held.append(batch)
        self._held_bytes += batch.nbytes
        if self._held_bytes >= self._chunk_bytes:
            self._scatter()

    def _scatter(self) -> None:
        """Every held row to a random bucket: one stable sort by bucket (a radix sort on 16-bit
        keys), one take, and one write of each bucket's slice."""
        if not self._held:
            return
        table = pa.Table.from_batches(self._held, schema=self.schema)
        self._held, self._held_bytes = [], 0
        count = len(self._writers)
        key = np.uint16 if count <= 1 << 16 else np.uint32
        bucket = self._bucket_rng.integers(0, count, table.num_rows, dtype=key)
        grouped = table.take(pa.array(np.argsort(bucket, kind="stable")))
        del table
        ends = np.cumsum(np.bincount(bucket, minlength=count))
        start = 0
        for b, end in enumerate(ends.tolist()):
            if end > start:
                part = grouped.slice(start, end - start)
                self._writers[b].write_table(part)
                self._bucket_bytes[b] += part.nbytes
            start = end

    def rows(self) -> Iterator[pa.Table]:
        """The shuffled rows, one table per bucket (one table in all while nothing was spilled)."""
        if not self.spilled:
            table = pa.Table.from_batches(self._held, schema=self.schema)
            self._held = []
            shuffled = _permuted(table, self._rng)
            del table
            yield shuffled
            return
        self._close_writers()
        try:
            for index, size in enumerate(self._bucket_bytes):
                path = os.path.join(self._dir, f"bucket-{index:05d}.arrow")
                if size > self.memory_bytes:
                    yield from self._reshuffle(path, index, size)
                    continue
                with pa.memory_map(path) as source:
                    table = pa.ipc.open_file(source).read_all()
                os.remove(path)  # the spill never holds more on disk than is left to write
                shuffled = _permuted(table, self._rng)
                del table
                yield shuffled
        finally:
            self.close()

    def _reshuffle(self, path: str, index: int, size: int) -> Iterator[pa.Table]:
        """A bucket too large to hold: its batches go through a shuffle of their own."""
        inner = ExternalShuffle(self.schema, [*np.atleast_1d(self.seed), 2, index], self.memory_bytes,
                                expected_bytes=size, spill_dir=self._spill_root)
        try:
            with pa.memory_map(path) as source:
                reader = pa.ipc.open_file(source)
                for i in range(reader.num_record_batches):
                    inner.add(reader.get_batch(i))
            os.remove(path)
            yield from inner.rows()
        finally:
            inner.close()

    def _close_writers(self, flush: bool = True) -> None:
        if self._writers_open:
            self._writers_open = False
            if flush:
                self._scatter()
            for writer in self._writers:
                writer.close()

    def close(self) -> None:
        """Remove the spill files (also after an error half-way)."""
        self._close_writers(flush=False)
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
