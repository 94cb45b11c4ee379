"""How much memory a table of declared size needs on its shards, and how much a shard has.

A held row costs its float32 line ([weights | optimizer slots], table.py), its id (8 bytes), its
update counter (4) and its share of the id index (4 bytes a position, the index between 35% and
70% full: at most ~11.4); a table indexed directly (index.py: declared, at most DIRECT_MAX_ROWS)
costs instead 4 bytes per declared id on every shard. A shard reserves its share of the declared rows with RESERVE_SLACK's
room (state.py), and its process costs SHARD_PROCESS_BYTES before any row.
"""

from __future__ import annotations

import os

from elastic_step.ps.api import SLOTS, TableSpec
from elastic_step.ps.index import MAX_LOAD, MAX_ROWS, uses_direct_index

RESERVE_SLACK = 1.1  # ids spread over the virtual shards by a hash, not exactly evenly: reserve with room
SHARD_PROCESS_BYTES = 128 << 20  # Python, numpy and the sockets of one shard process, measured ~100 MB
_CGROUP_LIMIT = "/sys/fs/cgroup/memory.max"  # cgroup v2: the container's limit ("max": none)


def bytes_per_row(spec: TableSpec) -> float:
    """A held row's bytes, its share of a hash index included (a direct index: shard_table_bytes)."""
    index = 0 if uses_direct_index(spec.rows) else 4 / (MAX_LOAD / 2)
    return 4 * spec.dim * (1 + SLOTS[spec.optimizer]) + 8 + 4 + index


def shard_table_bytes(spec: TableSpec, rows: int) -> float:
    """What a shard holding `rows` of the table needs for it, its index included."""
    return rows * bytes_per_row(spec) + (4 * spec.rows if uses_direct_index(spec.rows) else 0)


def reserved_rows(spec: TableSpec, fraction: float) -> int:
    """The rows a shard reserves for a declared table when it owns `fraction` of its virtual
    shards: that share of the declared rows, with room."""
    return int(spec.rows * fraction * RESERVE_SLACK)


def shard_share(spec: TableSpec, shards: int) -> int:
    """The rows one of `shards` shards reserves for a declared table (an even share, with room)."""
    return reserved_rows(spec, 1 / shards)


def shard_bytes(specs: list[TableSpec], shards: int) -> float:
    """The memory one shard needs for its share of every declared table (undeclared ones: none)."""
    return SHARD_PROCESS_BYTES + sum(shard_table_bytes(spec, shard_share(spec, shards)) for spec in specs if spec.rows)


def local_memory_bytes() -> int:
    """This machine's memory, or this container's limit where it has a lower one."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open(_CGROUP_LIMIT, encoding="ascii") as f:
            limit = f.read().strip()
    except OSError:
        return physical
    return min(physical, int(limit)) if limit.isdigit() else physical


def too_many_rows(specs: list[TableSpec], shards: int) -> TableSpec | None:
    """A declared table whose share would pass a shard's index limit (int32 slots), if any."""
    return next((spec for spec in specs if shard_share(spec, shards) > MAX_ROWS), None)
