"""One flat allreduce per step, and the in-process regroup: destroy the process group and
initialise a fresh one on a new prefix of the master's TCPStore, so no survivor restarts.

On gloo, a small step buffer is summed by a direct exchange (every rank sends its buffer to every
other rank at once, then adds them up in rank order) instead of gloo's ring allreduce: one
message hop instead of 2(N-1), which on a CPU cluster is most of a small model's step time
(benchmarks/README.md). Adding in rank order gives every rank the same bits, as the ring does.
Large buffers, where bandwidth matters more than hops, and NCCL keep the ring allreduce."""

from __future__ import annotations

import datetime
import os

import numpy as np
import torch
import torch.distributed as dist

from elastic_step.errors import ConfigError
from elastic_step.protocol import WorkerEnv

# Integers ride in the float32 step buffer as two exact halves (each < 2**22).
_HALF = 1 << 22
IDENTITY_FLOATS = 5  # per rank in gather_identities: step (two halves), lineage (three parts)

# Direct exchange while the bytes each rank sends, (N-1) x the buffer, stay at most this; for two
# ranks it sends exactly what the ring does, in one hop.
DIRECT_EXCHANGE_MAX_BYTES = 16 << 20

# The Kubernetes backend sets this to nccl on worker pods that request GPUs; unset means gloo.
BACKEND_ENV = WorkerEnv.COLLECTIVE_BACKEND.value
BACKENDS = ("gloo", "nccl")


def backend_from_env(environ=os.environ) -> str:
    value = environ.get(BACKEND_ENV, "").strip().lower() or "gloo"
    if value not in BACKENDS:
        raise ConfigError(f"{BACKEND_ENV}={environ[BACKEND_ENV]!r} is not a collective backend: set it to gloo or nccl, or unset it for gloo")
    return value


def encode_int(value: int) -> tuple[float, float]:
    return float(value // _HALF), float(value % _HALF)


def decode_int(high: float, low: float) -> int:
    return int(round(high)) * _HALF + int(round(low))


class Collective:
    def __init__(self, store_host: str, store_port: int, timeout_s: float, backend: str | None = None):
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.backend = backend or backend_from_env()
        # NCCL reduces only tensors on the GPU: the step buffer visits this device and comes back.
        self.device = torch.device("cpu")
        if self.backend == "nccl":
            if not torch.cuda.is_available():
                raise ConfigError(f"{BACKEND_ENV}=nccl but this worker sees no GPU: request GPUs for the worker pods, or use gloo")
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.store = dist.TCPStore(store_host, store_port, is_master=False, timeout=self.timeout)
        self.rank, self.world_size = 0, 1
        self._received: list[torch.Tensor] = []  # the other ranks' buffers, for direct exchange

    def join(self, prefix: str, rank: int, world_size: int) -> None:
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore(prefix, self.store),
            rank=rank,
            world_size=world_size,
            timeout=self.timeout,
        )
        self.rank, self.world_size = rank, world_size
        self._received = []

    def leave(self) -> None:
        # Always destroy before leaving a round or exiting: a live gloo group's threads can
        # abort the process ("terminate called") when it exits.
        if dist.is_initialized():
            dist.destroy_process_group()

    def allreduce_sum(self, buffer: np.ndarray) -> None:
        """Sum `buffer` over all ranks, in place. A dead peer fails it within a fraction of a
        second, a hung one at the group timeout (RuntimeError either way)."""
        if self.backend == "gloo" and self.world_size > 1 and (self.world_size - 1) * buffer.nbytes <= DIRECT_EXCHANGE_MAX_BYTES:
            self._exchange_sum(buffer)
            return
        tensor = torch.from_numpy(buffer).to(self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        if tensor.device.type != "cpu":
            buffer[:] = tensor.cpu().numpy()

    def _exchange_sum(self, buffer: np.ndarray) -> None:
        if not self._received or self._received[0].numel() != buffer.size:
            self._received = [torch.empty(buffer.size, dtype=torch.float32) for _ in range(self.world_size)]
        mine = torch.from_numpy(buffer)
        ops = []
        for peer in range(self.world_size):
            if peer != self.rank:
                ops.append(dist.P2POp(dist.isend, mine, peer))
                ops.append(dist.P2POp(dist.irecv, self._received[peer], peer))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        self._received[self.rank].copy_(mine)
        parts = [part.numpy() for part in self._received]
        np.copyto(buffer, parts[0])
        for part in parts[1:]:
            buffer += part

    def gather_identities(self, step: int, lineage: int) -> list[tuple[int, int]]:
        """Every rank's (step, lineage), in rank order: one small allreduce in which each rank
        fills its own slot. Integers travel as exact float halves (step + 1, so -1 fits)."""
        slots = np.zeros(self.world_size * IDENTITY_FLOATS, dtype=np.float32)
        mine = slots[self.rank * IDENTITY_FLOATS:(self.rank + 1) * IDENTITY_FLOATS]
        mine[0:2] = encode_int(step + 1)
        for i in range(3):  # 3 x 22 bits hold the 64-bit lineage
            mine[2 + i] = float((lineage >> (22 * i)) & (_HALF - 1))
        self.allreduce_sum(slots)
        identities = []
        for r in range(self.world_size):
            slot = slots[r * IDENTITY_FLOATS:(r + 1) * IDENTITY_FLOATS]
            lineage_r = sum(int(round(slot[2 + i])) << (22 * i) for i in range(3))
            identities.append((decode_int(slot[0], slot[1]) - 1, lineage_r))
        return identities

    def send_bytes(self, data: bytes, destinations: list[int]) -> None:
        """Point to point from this rank to each of `destinations` (each calls recv_bytes)."""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        for peer in destinations:
            dist.send(size, peer)
            dist.send(payload, peer)

    def recv_bytes(self, source: int) -> bytes:
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        dist.recv(size, source)
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.recv(payload, source)
        return payload.cpu().numpy().tobytes()

    def broadcast_bytes(self, data: bytes | None, src: int) -> bytes:
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=self.device)
        dist.broadcast(size, src)
        payload = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
            if data is not None
            else torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        )
        dist.broadcast(payload, src)
        return payload.cpu().numpy().tobytes()
