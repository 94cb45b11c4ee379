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
# lz4 is fast enough that spilling costs less than parsing; it shrinks columns of small numbers.
_IPC_OPTIONS = pa.ipc.IpcWriteOptions(compression="lz4")


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
        # Rows bound for each bucket wait here until a write is worth its cost (each IPC batch
        # compresses every column separately and carries its own metadata).
        self._pending: list[list[pa.RecordBatch]] = []
        self._pending_bytes: list[int] = []
        self._flush_bytes = 0

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
            self._spill(batch)
            return
        self._held.append(batch)
        self._held_bytes += batch.nbytes
        if self._held_bytes > self.memory_bytes:
            self._start_spilling()

    def _start_spilling(self) -> None:
        # Buckets of about half the budget: reading one back and permuting it holds two copies.
        count = max(2, math.ceil(2 * max(self.expected_bytes, 2 * self._held_bytes) / self.memory_bytes))
        self._bucket_bytes = [0] * count
        self._pending, self._pending_bytes = [[] for _ in range(count)], [0] * count
        self._flush_bytes = max(64 << 10, self.memory_bytes // (4 * count))  # a quarter of the budget in all
        self._dir = tempfile.mkdtemp(prefix="elastic-step-shuffle-", dir=self._spill_root)
        self._writers_open = True
        self._writers = [pa.ipc.new_file(os.path.join(self._dir, f"bucket-{b:05d}.arrow"), self.schema,
                                         options=_IPC_OPTIONS) for b in range(count)]
        held, self._held, self._held_bytes = self._held, [], 0
        for batch in held:
            self._spill(batch)

    def _spill(self, batch: pa.RecordBatch) -> None:
        count = len(self._writers)
        bucket = self._bucket_rng.integers(0, count, batch.num_rows)
        order = np.argsort(bucket, kind="stable")
        grouped = batch.take(pa.array(order))
        ends = np.cumsum(np.bincount(bucket, minlength=count))
        start = 0
        for b, end in enumerate(ends):
            if end > start:
                part = grouped.slice(start, end - start)
                self._pending[b].append(part)
                self._pending_bytes[b] += part.nbytes
                self._bucket_bytes[b] += part.nbytes
                if self._pending_bytes[b] >= self._flush_bytes:
                    self._write_pending(b)
            start = int(end)

    def _write_pending(self, bucket: int) -> None:
        if self._pending[bucket]:
            table = pa.Table.from_batches(self._pending[bucket], schema=self.schema).combine_chunks()
            self._writers[bucket].write_table(table)
            self._pending[bucket], self._pending_bytes[bucket] = [], 0

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
            for bucket, writer in enumerate(self._writers):
                if flush:
                    self._write_pending(bucket)
                writer.close()

    def close(self) -> None:
        """Remove the spill files (also after an error half-way)."""
        self._close_writers(flush=False)
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
