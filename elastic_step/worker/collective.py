"""One flat allreduce per step, and the in-process regroup: destroy the process group and
initialise a fresh one on a new prefix of the master's TCPStore, so no survivor restarts.

Before gloo's own rendezvous the members meet on the round's store keys (`meet`): gloo's
rendezvous cannot be left, so a member killed between the master's proposal and the group's
start used to hold every other member there until the collective timeout (30 s). At the meeting
each member sets its key and polls for the others', and gives up as soon as the master has
proposed a newer round (a member is gone). Whether the round goes ahead is one verdict in the
store, set by whoever decides first, so no member starts the group while another has given up.

On gloo, a small step buffer is summed by a direct exchange (every rank sends its buffer to every
other rank at once, then adds them up in rank order) instead of gloo's ring allreduce: one
message hop instead of 2(N-1), which on a CPU cluster is most of a small model's step time
(benchmarks/README.md). Adding in rank order gives every rank the same bits, as the ring does.
The exchange runs over the round's own peer links (peer_links.py), not gloo's point-to-point
calls, whose machinery cost more CPU than the bytes. A large buffer, where bandwidth matters more
than hops, is summed over the same links in parts: each rank sums one part (a reduce-scatter),
then sends it to every other (an all-gather). That moves the bytes gloo's ring does, in two hops
instead of 2(N-1), and, each part summed in rank order, gives the same bits as the direct
exchange. NCCL keeps its own ring allreduce.

On NCCL every operation of the group is started asynchronously and awaited here
(`await_or_abort`), looking the while at whether the master has moved on to a newer round (a
member died) and at the collective timeout; either ends the wait by aborting the group, and the
worker regroups. gloo fails on a dead peer's closed socket within a fraction of a second by
itself, but NCCL within one machine (shared memory, NVLink) never notices a dead peer: its kernel
spins until something aborts the communicator. So the wait must not block inside torch, and the
abort must be ours: the NCCL watchdog's own error handling is switched off
(TORCH_NCCL_ASYNC_ERROR_HANDLING=0, as torch asks of callers of _abort_process_group), because its
default tears the whole process down, the restart an elastic worker exists to avoid. gloo's
operations are waited on as they are: its abort waits for the operation it would end (measured:
as long as the hung peer stays), so a hung gloo peer is given up on at the collective timeout."""

from __future__ import annotations

import datetime
import logging
import os
import time
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from elastic_step.errors import ConfigError
from elastic_step.protocol import WorkerEnv
from elastic_step.worker.peer_links import PeerLinks, local_address

# Integers ride in the float32 step buffer as two exact halves (each < 2**22).
_HALF = 1 << 22
IDENTITY_FLOATS = 5  # per rank in gather_identities: step (two halves), lineage (three parts)

# Direct exchange while the bytes each rank sends, (N-1) x the buffer, stay at most this; for two
# ranks it sends exactly what the ring does, in one hop. Past it, the sum in parts.
DIRECT_EXCHANGE_MAX_BYTES = 16 << 20

# gloo's own rendezvous, once every member is at the meeting: the members set their addresses
# within moments of each other, so only a member that died just after the meeting is waited
# for, this long, not the collective timeout (the group's operations get that, after the start).
GROUP_START_TIMEOUT_S = 10.0
# How long the master's newer round must stand before a member waiting on a started NCCL operation
# aborts it: a newer round is also proposed for a joiner or a scale-in, where every member is alive
# and the operation ends as soon as the slowest member's step reaches it; the regroup then goes by
# the step's flag, with no abort. Only a wait that outlasts this is a dead or hung peer's.
GIVE_UP_GRACE_S = 2.0
NCCL_WATCHDOG_SLACK = datetime.timedelta(seconds=60)
# How often a member waiting on a started NCCL operation looks for its end, a newer round and the
# timeout: from the first value, doubling up to the second. A GPU step's collective takes about a
# millisecond, so a wait overshoots its end by at most half a millisecond; a look costs a CUDA
# event query and a clock read.
AWAIT_POLL_S = (0.00005, 0.0005)
# torch's NCCL watchdog: 0 leaves errors and timeouts to the caller (here: _await), where the
# default (3) ends the process on the first dead peer. Its heartbeat monitor would end it too,
# minutes after any error a survivor has long since regrouped from; and no debug dump is written.
NCCL_ERROR_HANDLING = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_ENABLE_MONITORING": "0",
                       "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
# How often a member at the meeting looks for the others (and for a newer round): from the first
# value, doubling up to the second, so a meeting of members that are all there costs a millisecond.
MEET_POLL_S = (0.001, 0.02)

log = logging.getLogger("elastic_step.worker")


class CollectiveAbandoned(RuntimeError):
    """An operation of the group was aborted: the master moved on to a newer round, or it outlasted
    the collective timeout. A RuntimeError, as a failed collective is: the worker regroups."""


class CommunicatorLost(Exception):
    """A group could not be started in a process that aborted one before: NCCL's state in this
    process may not have survived the abort, so the worker leaves (exit 1) and is relaunched as a
    fresh process rather than failing every round it is offered. Not a RuntimeError: the worker's
    regroup does not catch it."""


class MeetingAbandoned(RuntimeError):
    """The round's members did not all meet: one is missing and the master moved on (or the
    meeting outlasted its timeout). A RuntimeError, as a failed collective is: the worker
    regroups."""


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


def meet(store, rank: int, world_size: int, give_up: Callable[[], bool], timeout_s: float) -> None:
    """Wait at the round's meeting (`store`: the round's prefix) until every member is there;
    raise MeetingAbandoned once `give_up()` is true or `timeout_s` has passed with one missing.
    The first member to decide sets the verdict and every member obeys it: a member that gives up
    after the others saw everyone there goes ahead with them (it regroups at its first step)."""
    arrivals = [f"meet/{r}" for r in range(world_size)]
    store.set(arrivals[rank], b"1")
    deadline = time.monotonic() + timeout_s
    pause = MEET_POLL_S[0]
    while True:
        if store.check(["meet/verdict"]):
            verdict = store.get("meet/verdict")
        elif store.check(arrivals):
            verdict = store.compare_set("meet/verdict", "", "go")
        elif give_up() or time.monotonic() > deadline:
            verdict = store.compare_set("meet/verdict", "", "abandoned")
        else:
            time.sleep(pause)
            pause = min(2 * pause, MEET_POLL_S[1])
            continue
        if verdict == b"go":
            return
        missing = [r for r, key in enumerate(arrivals) if not store.check([key])]
        raise MeetingAbandoned(f"ranks {missing} of {world_size} did not come to the round's meeting")


class Collective:
    def __init__(self, store_host: str, store_port: int, timeout_s: float, link_key: bytes, backend: str | None = None,
                 gpu: str | None = None):
        """`link_key`: the job's shared secret, which a peer link's dialer proves it holds. `gpu`:
        the device this worker computes on, when a GPU ("cuda:N"): NCCL's communicator is bound to
        it, so a step buffer living there is summed in place."""
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.backend = backend or backend_from_env()
        # NCCL reduces only tensors on the GPU: a host buffer visits this device and comes back.
        self.device = torch.device("cpu")
        if self.backend == "nccl":
            if not torch.cuda.is_available():
                raise ConfigError(f"{BACKEND_ENV}=nccl but this worker sees no GPU: request GPUs for the worker pods, or use gloo")
            self.device = torch.device(gpu) if gpu else torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
            os.environ.update(NCCL_ERROR_HANDLING)  # read when the group is made (module docstring)
        self._give_up: Callable[[], bool] = lambda: False  # the round's: the master moved on
        self.aborted = False  # this process aborted a group (CommunicatorLost)
        self._store_address = (store_host, store_port)
        self.store = self._connect()
        self.rank, self.world_size = 0, 1
        self._link_key = link_key
        # Only gloo's rounds open peer links (where the worker reaches the master from: the
        # route its peers take too; GLOO_SOCKET_IFNAME, where set, picks gloo's own interface).
        self._link_host = local_address(store_host, store_port) if self.backend == "gloo" else ""
        self._links: PeerLinks | None = None  # the round's peer links (gloo with more than one rank)
        self._received: dict[int, np.ndarray] = {}  # the other ranks' messages, kept between steps

    def _connect(self) -> dist.TCPStore:
        host, port = self._store_address
        return dist.TCPStore(host, port, is_master=False, timeout=self.timeout)

    def join(self, prefix: str, rank: int, world_size: int, give_up: Callable[[], bool] = lambda: False) -> None:
        """Meet the round's members, then start its group. MeetingAbandoned (a RuntimeError) when
        a member is missing and `give_up()` says the master moved on; a RuntimeError when a
        member died between the meeting and the group's start."""
        store = dist.PrefixStore(prefix, self.store)
        meet(store, rank, world_size, give_up, self.timeout.total_seconds())
        start_timeout = datetime.timedelta(seconds=min(GROUP_START_TIMEOUT_S, self.timeout.total_seconds()))
        # NCCL's communicator is made now, on this worker's GPU, within the start timeout (not at
        # the first collective, where a member that died meanwhile would hold the others).
        bound = {"device_id": self.device} if self.backend == "nccl" else {}
        try:
            dist.init_process_group(self.backend, store=store, rank=rank, world_size=world_size, timeout=start_timeout, **bound)
        except RuntimeError as exc:
            # A timed-out wait may still be answered later on this connection, where it would
            # read as the answer to another request: the next round gets a fresh connection.
            self.store = self._connect()
            if self.aborted:
                raise CommunicatorLost(f"no {self.backend} group could be started after this process aborted one "
                                       f"({exc}); leaving to be relaunched as a fresh process") from exc
            raise
        # The group's operations: the collective timeout. NCCL's own watchdog gets more, so that
        # await_or_abort's deadline, which aborts the group, always comes first.
        dist.distributed_c10d._set_pg_timeout(self.timeout if self.backend == "gloo" else 2 * self.timeout + NCCL_WATCHDOG_SLACK)
        self.rank, self.world_size = rank, world_size
        self._give_up = give_up
        self._received = {}
        if self.backend == "gloo" and world_size > 1:
            # Within the group's start timeout: every member is past gloo's start, so only a
            # member that died since is waited for.
            self._links = PeerLinks.open(store, prefix, rank, world_size, self._link_host, self._link_key,
                                         start_timeout.total_seconds(), give_up=give_up,
                                         exchange_timeout_s=self.timeout.total_seconds())

    def leave(self) -> None:
        # Always destroy before leaving a round or exiting: a live gloo group's threads can
        # abort the process ("terminate called") when it exits.
        if self._links is not None:
            self._links.close()
            self._links = None
        if dist.is_initialized():
            dist.destroy_process_group()

    def allreduce_sum(self, buffer: np.ndarray | torch.Tensor) -> None:
        """Sum `buffer` over all ranks, in place: a numpy array, or a float32 tensor (one on this
        collective's GPU is summed there by NCCL, with no copy). A dead peer fails it within a
        fraction of a second on gloo; on NCCL, a newer round that has stood GIVE_UP_GRACE_S ends
        it; a hung peer, the collective timeout (RuntimeError in every case)."""
        if isinstance(buffer, torch.Tensor):
            if buffer.device == self.device and self.device.type != "cpu":
                self._await(dist.all_reduce(buffer, op=dist.ReduceOp.SUM, async_op=True))
                return
            buffer = buffer.numpy()  # a host tensor: numpy shares its memory
        if self._links is not None:
            if (self.world_size - 1) * buffer.nbytes <= DIRECT_EXCHANGE_MAX_BYTES:
                self._exchange_sum(buffer)
            else:
                self._sum_in_parts(buffer)
            return
        tensor = torch.from_numpy(buffer).to(self.device)
        self._await(dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True))
        if tensor.device.type != "cpu":
            buffer[:] = tensor.cpu().numpy()

    def _await(self, work) -> None:
        """Wait for a started operation of the group (module docstring)."""
        if self.backend == "nccl":
            await_or_abort(work, self._give_up, self.timeout.total_seconds(), self._abort,
                           f"nccl collective of rank {self.rank} of {self.world_size}")
        else:
            work.wait()

    def _abort(self) -> None:
        self.aborted = True
        dist.distributed_c10d._abort_process_group()  # every pending operation of the group ends with an error

    def _others(self) -> list[int]:
        return [q for q in range(self.world_size) if q != self.rank]

    def _receiving(self, size: int) -> dict[int, np.ndarray]:
        """A buffer of `size` floats for each other rank's message, kept from step to step."""
        if len(self._received) != self.world_size - 1 or next(iter(self._received.values())).size != size:
            self._received = {q: np.empty(size, dtype=np.float32) for q in self._others()}
        return self._received

    def _exchange_sum(self, buffer: np.ndarray) -> None:
        received = self._receiving(buffer.size)
        self._links.exchange({q: buffer for q in self._others()}, received)
        _sum_in_rank_order(buffer, received, self.rank, self.world_size)

    def _sum_in_parts(self, buffer: np.ndarray) -> None:
        """Rank q sums part q of the buffer from every rank's copy of it, then every rank sends
        its summed part to every other, straight into their buffers."""
        bounds = np.linspace(0, buffer.size, self.world_size + 1).astype(np.int64)
        parts = [buffer[bounds[q]:bounds[q + 1]] for q in range(self.world_size)]
        mine = parts[self.rank]
        received = self._receiving(mine.size)
        self._links.exchange({q: parts[q] for q in self._others()}, received)
        _sum_in_rank_order(mine, received, self.rank, self.world_size)
        self._links.exchange({q: mine for q in self._others()}, {q: parts[q] for q in self._others()})

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
            self._await(dist.isend(size, peer))
            self._await(dist.isend(payload, peer))

    def recv_bytes(self, source: int) -> bytes:
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._await(dist.irecv(size, source))
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._await(dist.irecv(payload, source))
        return payload.cpu().numpy().tobytes()

    def broadcast_bytes(self, data: bytes | None, src: int) -> bytes:
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=self.device)
        self._await(dist.broadcast(size, src, async_op=True))
        payload = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
            if data is not None
            else torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        )
        self._await(dist.broadcast(payload, src, async_op=True))
        return payload.cpu().numpy().tobytes()


def await_or_abort(work, give_up: Callable[[], bool], timeout_s: float, abort: Callable[[], None], what: str,
                   grace_s: float = GIVE_UP_GRACE_S) -> None:
    """Wait for a started operation `work` to end; when `give_up()` has been true for `grace_s`
    or `timeout_s` passes first, call `abort()` (which ends every pending operation of the group)
    and raise CollectiveAbandoned naming `what` and why. An operation that ended with an error
    aborts and raises the same way: with torch's NCCL error handling off, wait() does not raise it,
    and the buffer holds no sum."""
    now = time.monotonic()
    deadline, moved_on_at = now + timeout_s, None
    pause = AWAIT_POLL_S[0]
    while not work.is_completed():
        now = time.monotonic()
        if moved_on_at is None and give_up():
            moved_on_at = now
        moved_on = moved_on_at is not None and now - moved_on_at >= grace_s
        if moved_on or now > deadline:
            abort()
            why = (f"the master moved on to a newer round {grace_s:g} s ago" if moved_on
                   else f"no answer within {timeout_s:g} s")
            raise CollectiveAbandoned(f"{what} abandoned: {why}")
        time.sleep(pause)
        pause = min(2 * pause, AWAIT_POLL_S[1])
    failure = work.exception()
    if failure is not None:
        abort()
        raise CollectiveAbandoned(f"{what} failed: {failure}")
    work.wait()


def _sum_in_rank_order(mine: np.ndarray, others: dict[int, np.ndarray], rank: int, world: int) -> None:
    """`mine` becomes the sum in rank order, (p0 + p1) + p2 ..., made in place: the ranks before
    this one summed in the first of them, this rank's own part added to that (a + b is b + a, bit
    for bit), then the later ranks'. Every rank gets the same bits, with no copy of the buffer."""
    if rank > 0:
        before = others[0]
        for q in range(1, rank):
            before += others[q]
        mine += before
    for q in range(rank + 1, world):
        mine += others[q]
