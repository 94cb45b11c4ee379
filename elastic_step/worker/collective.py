"""One flat allreduce per step, and the in-process regroup: destroy the process group and
initialise a fresh one on a new prefix of the master's TCPStore, so no survivor restarts."""

from __future__ import annotations

import datetime
import os

import numpy as np
import torch
import torch.distributed as dist

from elastic_step.errors import ConfigError

# Integers ride in the float32 step buffer as two exact halves (each < 2**22).
_HALF = 1 << 22

# The Kubernetes backend sets this to nccl on worker pods that request GPUs; unset means gloo.
BACKEND_ENV = "ELASTIC_STEP_COLLECTIVE_BACKEND"
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
        tensor = torch.from_numpy(buffer).to(self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        if tensor.device.type != "cpu":
            buffer[:] = tensor.cpu().numpy()

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
