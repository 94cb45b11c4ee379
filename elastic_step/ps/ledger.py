"""The shard's update ledger: an append-only file of accepted pushes, fsync'd before the ack.

One record per accepted push (little-endian):

    magic "ESL1" | u32 payload length | u32 CRC-32 of the payload
    payload: i64 task | i64 batch_seq | i32 attempt | u32 count | u16 table-name length |
             table name (UTF-8) | count x i64 ids | count x dim x f32 gradients (merged per id)

A shard appends a record and fsyncs it before it answers the push, so an acknowledged update is
on disk. The fsync covers every record written before it (a group commit): pushes from several
workers share one fsync, and pulls go on meanwhile. It starts as soon as the record is written,
on a thread of its own (`start_sync`), so that the disk's wait overlaps the shard applying the
push in memory; the push is acknowledged once both are done (`sync_through`). A SIGKILL can
tear only the record being written, which nobody was told about: `replay` stops at the first
record that is short or fails its CRC and cuts the file there.
`rotate` starts an empty ledger after a snapshot has been made durable (shard.py).
"""

from __future__ import annotations

import os
import queue
import struct
import threading
import zlib
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

MAGIC = b"ESL1"
_RECORD = struct.Struct("<4sII")
_FIELDS = struct.Struct("<qqiIH")


@dataclass
class LedgerRecord:
    table: str
    task: int
    batch_seq: int
    attempt: int
    ids: np.ndarray
    grads: np.ndarray


def encode(record: LedgerRecord) -> bytes:
    return b"".join(_parts(record))


def _parts(record: LedgerRecord) -> list:
    """The record as buffers to write one after the other: the arrays' own memory, not copies
    (a push's record is ~130 KB, and joining it copied it twice)."""
    name = record.table.encode()
    payload = [
        _FIELDS.pack(record.task, record.batch_seq, record.attempt, len(record.ids), len(name)) + name,
        np.ascontiguousarray(record.ids, dtype="<i8").reshape(-1).view(np.uint8),  # bytes, an empty array too
        np.ascontiguousarray(record.grads, dtype="<f4").reshape(-1).view(np.uint8),
    ]
    crc = 0
    for part in payload:
        crc = zlib.crc32(part, crc)
    return [_RECORD.pack(MAGIC, sum(len(part) for part in payload), crc), *payload]


def _decode(payload: bytes, dim_of: Callable[[str], int]) -> LedgerRecord:
    task, batch_seq, attempt, count, name_len = _FIELDS.unpack_from(payload)
    offset = _FIELDS.size + name_len
    table = payload[_FIELDS.size : offset].decode()
    ids = np.frombuffer(payload, dtype="<i8", count=count, offset=offset)
    grads, dim = np.frombuffer(payload, dtype="<f4", offset=offset + 8 * count), dim_of(table)
    if len(grads) != count * dim:  # a whole record (its CRC held) of another dim: the table was declared so then
        raise ValueError(f"pushes to table {table!r} of dim {len(grads) // max(count, 1)}, not the declared {dim}: "
                         "declare the dim it was trained with")
    return LedgerRecord(table, task, batch_seq, attempt, ids, grads.reshape(count, dim))


class LedgerFailed(OSError):
    """An fsync of the ledger failed. Linux reports a write-back error once and may drop the
    pages it could not write, so a later fsync that succeeds vouches for nothing written before:
    no push may be acknowledged by this process again. The shard stops. Its relaunch replays the
    ledger, which the kernel may serve from pages it never wrote, and so writes a snapshot of
    what it replayed before it serves (state.py, LEDGER_FAILED_FILE); the unacknowledged pushes
    are sent again."""


def _fsync_dir(path: str) -> None:
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Ledger:
    def __init__(self, path: str, sync: bool = True):
        self.path = path
        self.sync = sync  # False only to measure what the fsync costs (benchmarks)
        self.file = open(path, "ab", buffering=0)
        _fsync_dir(path)
        # Bytes ever appended / made durable, across rotations: a waiter's mark stays meaningful.
        self.written = self.durable = 0
        self.failed: OSError | None = None  # the fsync that failed: sticky (LedgerFailed)
        self.sync_lock = threading.Lock()
        # Marks for the ledger's fsync thread; one thread, as an fsync covers every record before
        # it. A bare queue and loop, not an executor: that thread holds the GIL only between its
        # waits, and an executor's futures kept it from the shard's apply for ~50 µs a push.
        self._to_sync: queue.SimpleQueue | None = None

    def append(self, record: LedgerRecord) -> int:
        """Write a record (the caller holds the shard's lock); the mark to sync_through."""
        if self.failed is not None:  # a rotation that failed may have left no file open
            raise self._refusal()
        parts, fd = _parts(record), self.file.fileno()
        size, end = sum(len(part) for part in parts), os.lseek(fd, 0, os.SEEK_END)
        try:
            if os.writev(fd, parts) != size:  # a full disk may take part of it
                raise OSError(f"{self.path}: a ledger record was written short (is the disk full?)")
        except OSError:
            os.ftruncate(fd, end)  # no torn record before the next one: replay would stop at it
            raise
        self.written += size
        return self.written

    def start_sync(self, mark: int) -> None:
        """Begin making every byte up to `mark` durable, on the ledger's own thread: the fsync is
        a wait on the disk, and the caller applies the push meanwhile. `sync_through(mark)` still
        decides: it returns once that fsync (or its own, if this one failed) has covered `mark`."""
        if not self.sync:
            return
        if self._to_sync is None:
            self._to_sync = queue.SimpleQueue()
            threading.Thread(target=self._sync_marks, args=(self._to_sync,), name="ledger-fsync", daemon=True).start()
        self._to_sync.put(mark)

    def _sync_marks(self, marks: queue.SimpleQueue) -> None:
        """The ledger's fsync thread, until close() sends None."""
        while (mark := marks.get()) is not None:
            try:
                self.sync_through(mark)
            except Exception:  # an fsync's is kept in self.failed; sync_through on the push's own thread raises either
                pass

    def sync_through(self, mark: int) -> None:
        """Return once every byte up to `mark` is on disk (one fsync serves every waiter)."""
        if not self.sync:
            return
        with self.sync_lock:
            if self.failed is not None:
                raise self._refusal()
            # Closed by a rollback (state.py): what it held is void; by ShardState.close: synced first.
            if self.durable >= mark or self.file.closed:
                return
            target = self.written  # everything written by now, at least `mark`
            try:
                os.fsync(self.file.fileno())
            except OSError as exc:
                self.failed = exc
                raise LedgerFailed(f"{self.path}: fsync failed ({exc}); records before it may not be on disk") from exc
            self.durable = target

    def _refusal(self) -> LedgerFailed:
        return LedgerFailed(f"{self.path}: an fsync failed ({self.failed}); records before it may not be on disk")

    def rotate(self) -> None:
        """Start an empty ledger (its records are all in the snapshot just made durable)."""
        with self.sync_lock:
            self.file.close()
            fresh = self.path + ".new"
            try:
                with open(fresh, "wb") as f:
                    os.fsync(f.fileno())
                os.replace(fresh, self.path)
                _fsync_dir(self.path)
                self.file = open(self.path, "ab", buffering=0)
            except OSError as exc:  # the ledger is closed: no push can be taken until a relaunch
                self.failed = exc
                raise LedgerFailed(f"{self.path}: starting an empty ledger failed ({exc})") from exc
            self.durable = self.written

    def close(self) -> None:
        """Close the file: a sync_through after it returns at once (the caller synced what it must)."""
        with self.sync_lock:  # a started fsync finishes first: none runs on a closed (reused) descriptor
            self.file.close()
        if self._to_sync is not None:
            self._to_sync.put(None)  # the fsync thread ends


def replay(path: str, dim_of: Callable[[str], int]) -> Iterator[LedgerRecord]:
    """The ledger's whole records in order; a torn tail is cut off the file."""
    if not os.path.exists(path):
        return
    with open(path, "rb") as f:
        data = f.read()
    offset = 0
    while offset + _RECORD.size <= len(data):
        magic, length, crc = _RECORD.unpack_from(data, offset)
        payload = data[offset + _RECORD.size : offset + _RECORD.size + length]
        if magic != MAGIC or len(payload) != length or zlib.crc32(payload) != crc:
            break
        yield _decode(payload, dim_of)
        offset += _RECORD.size + length
    if offset < len(data):
        with open(path, "r+b") as f:
            f.truncate(offset)
            os.fsync(f.fileno())
