"""One flat allreduce per step, and the in-process regroup: destroy the process group and
initialise a fresh one on a new prefix of the master's TCPStore, so no survivor restarts."""

from __future__ import annotations

import datetime

import numpy as np
import torch
import torch.distributed as dist

# Integers ride in the float32 step buffer as two exact halves (each < 2**22).
_HALF = 1 << 22


def encode_int(value: int) -> tuple[float, float]:
    return float(value // _HALF), float(value % _HALF)


def decode_int(high: float, low: float) -> int:
    return int(round(high)) * _HALF + int(round(low))


class Collective:
    def __init__(self, store_host: str, store_port: int, timeout_s: float, backend: str = "gloo"):
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.backend = backend
        self.store = dist.TCPStore(store_host, store_port, is_master=False, timeout=self.timeout)

    def join(self, prefix: str, rank: int, world_size: int) -> None:
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore(prefix, self.store),
            rank=rank,
            world_size=world_size,
            timeout=self.timeout,
        )

    def leave(self) -> None:
        # Always destroy before leaving a round or exiting: a live gloo group's threads can
        # abort the process ("terminate called") when it exits.
        if dist.is_initialized():
            dist.destroy_process_group()

    def allreduce_sum(self, buffer: np.ndarray) -> None:
        dist.all_reduce(torch.from_numpy(buffer), op=dist.ReduceOp.SUM)

    def broadcast_bytes(self, data: bytes | None, src: int) -> bytes:
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        dist.broadcast(size, src)
        payload = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data is not None
            else torch.empty(int(size.item()), dtype=torch.uint8)
        )
        dist.broadcast(payload, src)
        return payload.numpy().tobytes()
