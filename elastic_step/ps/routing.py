"""Routing: ids -> virtual shards -> shard processes, under a routing epoch.

Every table's ids hash into V virtual shards (128 by default); a RoutingTable maps each virtual
shard onto one of N shard processes. Changing N moves whole virtual shards, and `resized` moves
only the ones it must: each shard keeps all it can of what it owns, so growing N -> N+1 or
shrinking N+1 -> N moves about V/(N+1) of the V virtual shards, i.e. ~1/(N+1) of the rows,
where `id % N` would move nearly all of them. Every change bumps the epoch; a shard refuses a
request made under any other epoch (api.Status.STALE_EPOCH), and the client refreshes its routes
and retries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

DEFAULT_VIRTUAL_SHARDS = 128
_MIX = np.uint64(0xFF51AFD7ED558CCD)  # murmur3's finaliser constant: not the index's hash


def virtual_shard_of(ids: np.ndarray, virtual_shards: int) -> np.ndarray:
    """Each id's virtual shard (a hash, so that dense id ranges spread evenly). In place on one
    copy of the ids, and a mask for a power-of-two count (the same as the remainder, without
    a division): every pull and push routes its ids."""
    z = ids.astype(np.uint64)
    z ^= z >> np.uint64(33)
    z *= _MIX
    z ^= z >> np.uint64(33)
    if virtual_shards & (virtual_shards - 1) == 0:
        z &= np.uint64(virtual_shards - 1)
    else:
        z %= np.uint64(virtual_shards)
    return z.astype(np.int64)


@dataclass
class RoutingTable:
    epoch: int
    owners: np.ndarray  # owners[v]: the index of the shard process serving virtual shard v
    endpoints: list[str] = field(default_factory=list)  # "host:port" of each shard process

    @classmethod
    def initial(cls, shards: int, endpoints: list[str] | None = None, virtual_shards: int = DEFAULT_VIRTUAL_SHARDS) -> RoutingTable:
        if not 1 <= shards <= virtual_shards:
            raise ValueError(f"{shards} shards: use between 1 and {virtual_shards} (the virtual shards)")
        return cls(1, np.arange(virtual_shards) % shards, list(endpoints or []))

    @property
    def shards(self) -> int:
        return int(self.owners.max()) + 1

    def shard_of(self, ids: np.ndarray) -> np.ndarray:
        return self.owners[virtual_shard_of(ids, len(self.owners))]

    def owned_by(self, shard: int) -> np.ndarray:
        return np.flatnonzero(self.owners == shard)

    def resized(self, shards: int, endpoints: list[str] | None = None) -> RoutingTable:
        """The routing for `shards` processes, the next epoch, moving as few virtual shards as
        balance allows (every process ends with V // shards or one more)."""
        if not 1 <= shards <= len(self.owners):
            raise ValueError(f"{shards} shards: use between 1 and {len(self.owners)} (the virtual shards)")
        owners = self.owners.copy()
        counts = np.bincount(owners, minlength=max(shards, self.shards))[:shards]
        quotas = _quotas(counts, len(owners))
        released = [v for v in range(len(owners)) if owners[v] >= shards]
        for shard in range(shards):
            mine = np.flatnonzero(owners == shard)
            released.extend(mine[quotas[shard] :].tolist())  # keep the lowest, give up the rest
        short = [s for s in range(shards) for _ in range(max(0, quotas[s] - int(counts[s])))]
        for virtual, shard in zip(sorted(released), short, strict=True):
            owners[virtual] = shard
        return RoutingTable(self.epoch + 1, owners, list(endpoints if endpoints is not None else self.endpoints[:shards]))

    def to_json(self) -> dict:
        return {"epoch": self.epoch, "owners": self.owners.tolist(), "endpoints": self.endpoints}

    @classmethod
    def from_json(cls, data: dict) -> RoutingTable:
        return cls(int(data["epoch"]), np.asarray(data["owners"], dtype=np.int64), list(data.get("endpoints", [])))


def _quotas(counts: np.ndarray, virtual_shards: int) -> list[int]:
    """V // N each, and the V % N spare ones to the shards holding most now (fewer moves)."""
    shards = len(counts)
    quotas = [virtual_shards // shards] * shards
    for shard in sorted(range(shards), key=lambda s: (-int(counts[s]), s))[: virtual_shards % shards]:
        quotas[shard] += 1
    return quotas
