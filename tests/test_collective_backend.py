"""The worker's collective backend comes from ELASTIC_STEP_COLLECTIVE_BACKEND (set to nccl by the
Kubernetes backend on GPU worker pods), gloo when unset. The worker builds its Collective without
naming a backend, so these tests do the same."""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from elastic_step.errors import ConfigError
from elastic_step.worker.collective import BACKEND_ENV, Collective, backend_from_env


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield master
    del master


def one_rank_round(collective: Collective) -> tuple[str, np.ndarray, bytes]:
    collective.join("round-1/", rank=0, world_size=1)
    try:
        buffer = np.array([1.5, 2.0, 3.0], dtype=np.float32)
        collective.allreduce_sum(buffer)
        return dist.get_backend(), buffer, collective.broadcast_bytes(b"model state", src=0)
    finally:
        collective.leave()


def test_backend_is_read_from_the_environment():
    assert backend_from_env({}) == "gloo"
    assert backend_from_env({BACKEND_ENV: ""}) == "gloo"
    assert backend_from_env({BACKEND_ENV: "nccl"}) == "nccl"
    assert backend_from_env({BACKEND_ENV: " NCCL "}) == "nccl"
    assert backend_from_env({BACKEND_ENV: "gloo"}) == "gloo"


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ConfigError, match=rf"{BACKEND_ENV}='mpi'.*gloo or nccl"):
        backend_from_env({BACKEND_ENV: "mpi"})


def test_worker_collective_defaults_to_gloo_and_really_reduces(store, monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    collective = Collective("127.0.0.1", store.port, timeout_s=20, link_key=b"k")
    assert collective.backend == "gloo"
    backend, buffer, payload = one_rank_round(collective)
    assert backend == "gloo"
    assert buffer.tolist() == [1.5, 2.0, 3.0]
    assert payload == b"model state"


def test_nccl_from_the_environment_without_a_gpu_is_a_clear_error(store, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on GPU machines
    with pytest.raises(ConfigError, match=rf"{BACKEND_ENV}=nccl but this worker sees no GPU"):
        Collective("127.0.0.1", store.port, timeout_s=20, link_key=b"k")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_nccl_from_the_environment_reduces_on_the_gpu(store, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "nccl")
    collective = Collective("127.0.0.1", store.port, timeout_s=60, link_key=b"k")
    assert collective.backend == "nccl" and collective.device.type == "cuda"
    backend, buffer, payload = one_rank_round(collective)
    assert backend == "nccl"
    assert buffer.tolist() == [1.5, 2.0, 3.0]
    assert payload == b"model state"


# Each rank sums a buffer that differs by rank, once by direct exchange and once (threshold
# lowered to 0) in parts, as a buffer past the direct exchange's limit is, and writes what it got.
_RANK_SCRIPT = """
import sys, numpy as np
from elastic_step.worker import collective as module
port, rank, world, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
c = module.Collective("127.0.0.1", port, timeout_s=30, link_key=b"k")
c.join("round-1/", rank=rank, world_size=world)
try:
    direct = np.random.default_rng(rank).standard_normal(17_000).astype(np.float32)
    c.allreduce_sum(direct)
    module.DIRECT_EXCHANGE_MAX_BYTES = 0
    parts = np.random.default_rng(rank).standard_normal(17_001).astype(np.float32)  # parts of unequal size
    c.allreduce_sum(parts)
finally:
    c.leave()
np.savez(out, direct=direct, parts=parts)
"""


@pytest.mark.parametrize("world", [2, 3])
def test_buffers_are_summed_by_direct_exchange_or_in_parts_identically_on_every_rank(store, tmp_path, world):
    import subprocess
    import sys

    ranks = [
        subprocess.Popen([sys.executable, "-c", _RANK_SCRIPT, str(store.port), str(rank), str(world), str(tmp_path / f"r{rank}.npz")])
        for rank in range(world)
    ]
    try:
        assert [p.wait(timeout=120) for p in ranks] == [0] * world
    finally:
        for p in ranks:  # a rank left waiting on a failed peer must not outlive the test
            if p.poll() is None:
                p.kill()
                p.wait()
    results = [np.load(tmp_path / f"r{rank}.npz") for rank in range(world)]
    inputs = [np.random.default_rng(rank).standard_normal(17_000).astype(np.float32) for rank in range(world)]
    in_rank_order = inputs[0].copy()
    for part in inputs[1:]:
        in_rank_order += part
    longer = [np.random.default_rng(rank).standard_normal(17_001).astype(np.float32) for rank in range(world)]
    parts_in_rank_order = longer[0].copy()
    for part in longer[1:]:
        parts_in_rank_order += part
    for result in results:
        # The direct exchange adds in rank order: exactly the same bits on every rank.
        assert result["direct"].tobytes() == in_rank_order.tobytes()
        # In parts (large buffers), each part summed in rank order by its rank: the same bits too.
        assert result["parts"].tobytes() == parts_in_rank_order.tobytes()
