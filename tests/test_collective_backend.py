"""The worker's collective backend comes from ELASTIC_STEP_COLLECTIVE_BACKEND (set to nccl by the
Kubernetes backend on GPU worker pods), gloo when unset. The worker builds its Collective without
naming a backend, so these tests do the same."""

import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from elastic_step.errors import ConfigError
from elastic_step.worker.collective import (BACKEND_ENV, Collective, CollectiveAbandoned, CommunicatorLost, await_or_abort,
                                          backend_from_env)


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


# Rank 1 joins the round and then hangs (as a SIGSTOPped peer does: nothing closes its sockets).
# On gloo, rank 0's state broadcast ends at the collective timeout (gloo's own error), and a new
# round starts in the same process.
_HUNG_PEER_SCRIPT = """
import json, sys, time
import numpy as np
from elastic_step.worker.collective import Collective
port, rank, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
c = Collective("127.0.0.1", port, timeout_s=3, link_key=b"k")
c.join("round-1/", rank=rank, world_size=2)
if rank == 1:
    time.sleep(60)  # joined, never answers
started = time.monotonic()
try:
    c.broadcast_bytes(b"state" * 1000, src=0)
    result = {"error": None}
except RuntimeError as exc:
    result = {"error": str(exc)}
result["seconds"] = time.monotonic() - started
c.leave()
c.join("round-2/", rank=0, world_size=1)  # the survivor's next round, in the same process
buffer = np.array([1.0, 2.0], dtype=np.float32)
c.allreduce_sum(buffer)
result["next_round"] = [buffer.tolist(), c.broadcast_bytes(b"x", src=0).decode()]
c.leave()
json.dump(result, open(out, "w"))
"""


def test_a_hung_gloo_peer_fails_the_survivors_collective_at_the_timeout_and_the_next_round_starts(store, tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "rank0.json"
    ranks = [subprocess.Popen([sys.executable, "-c", _HUNG_PEER_SCRIPT, str(store.port), str(rank), str(out)])
             for rank in range(2)]
    try:
        assert ranks[0].wait(timeout=60) == 0
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    result = json.loads(out.read_text())
    assert result["error"] and 2.9 <= result["seconds"] < 6.0, result
    assert result["next_round"] == [[1.0, 2.0], "x"]


class Work:
    """An operation of a group as torch hands it back: pending until `done_after` polls; then
    finished, or failed with `error` (which NCCL's wait() does not raise with its error handling
    off: exception() tells)."""

    def __init__(self, done_after: float = float("inf"), error: Exception | None = None):
        self.polls, self.done_after, self.error, self.waited = 0, done_after, error, False

    def is_completed(self) -> bool:
        self.polls += 1
        return self.polls > self.done_after

    def exception(self):
        return self.error

    def wait(self) -> None:
        self.waited = True


def test_an_nccl_wait_aborts_the_group_when_the_master_moved_on_a_grace_ago_at_the_timeout_or_on_an_error():
    # NCCL's own abort needs a GPU (benchmarks/nccl_check.py runs it); here, the wait around it.
    aborted = []
    work = Work()
    started = time.monotonic()
    with pytest.raises(CollectiveAbandoned, match=r"^rank 0 abandoned: the master moved on to a newer round 0.3 s ago$"):
        await_or_abort(work, lambda: time.monotonic() > started + 0.2, 30, lambda: aborted.append("moved on"), "rank 0",
                       grace_s=0.3)
    assert aborted == ["moved on"] and not work.waited and 0.5 <= time.monotonic() - started < 1.5
    with pytest.raises(CollectiveAbandoned, match=r"abandoned: no answer within 0.3 s$"):
        await_or_abort(Work(), lambda: False, 0.3, lambda: aborted.append("timeout"), "rank 0")
    assert aborted == ["moved on", "timeout"]
    # A newer round for a joiner: every member is alive and the operation ends within the grace.
    finished = Work(done_after=200)
    await_or_abort(finished, lambda: True, 30, lambda: aborted.append("wrong"), "rank 0", grace_s=5)
    assert finished.waited and aborted == ["moved on", "timeout"]
    failed = Work(done_after=0, error=RuntimeError("NCCL error: remote process exited"))
    with pytest.raises(CollectiveAbandoned, match=r"^rank 0 failed: NCCL error: remote process exited$"):
        await_or_abort(failed, lambda: False, 30, lambda: aborted.append("failed"), "rank 0")
    assert aborted == ["moved on", "timeout", "failed"] and not failed.waited  # its buffer holds no sum


def test_a_group_that_cannot_start_after_this_process_aborted_one_makes_the_worker_leave(store, monkeypatch):
    # Before any abort, a failed start is a peer's death at the start: the worker regroups
    # (RuntimeError). After one, NCCL's state in the process is suspect: it leaves to be relaunched.
    collective = Collective("127.0.0.1", store.port, timeout_s=20, link_key=b"k")

    def refused(*args, **kwargs):
        raise RuntimeError("NCCL error: unhandled system error")

    monkeypatch.setattr(dist, "init_process_group", refused)
    with pytest.raises(RuntimeError, match="unhandled system error") as first:
        collective.join("round-1/", rank=0, world_size=1)
    assert not isinstance(first.value, CommunicatorLost)
    collective.aborted = True  # as _abort leaves it
    with pytest.raises(CommunicatorLost, match=r"^no gloo group could be started after this process aborted one "
                                               r"\(NCCL error: unhandled system error\); leaving to be relaunched"):
        collective.join("round-2/", rank=0, world_size=1)
    assert not issubclass(CommunicatorLost, RuntimeError)  # the worker's regroup does not swallow it
