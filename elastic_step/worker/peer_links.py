"""A TCP connection to every other member of a round, over which the step buffer's direct
exchange runs: each step, one send and one receive per peer, and nothing in between.

gloo's point-to-point send and receive of the same buffer cost about 0.3-0.4 ms of CPU on each
side (its device thread, its queues and the wake-ups between them), a tenth of a small model's
step; a socket's send and receive cost about 0.06 ms (benchmarks/README.md). gloo's group is kept
for everything else: state sharing, the identity check, the ring for large buffers.

A link is opened by the higher rank, bound to the address this worker uses to reach the master
(the pod's own address, or loopback on one machine), and admitted only once the dialer has shown
it holds the job's token: the listener sends a fresh nonce, the dialer answers with its rank and
an HMAC of the nonce, the round and both ranks under the token. That keeps a stranger who can
reach the port from feeding a round its bytes; it does not authenticate the listener, whose
address comes from the master's store (gloo trusts that store for its own addresses too).

Every message starts with its payload's byte count, so ranks that disagree on the buffer fail
loudly instead of reading each other's bytes out of step.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import select
import socket
import struct
import time
from typing import Callable

import numpy as np

log = logging.getLogger("elastic_step.worker")

_NONCE_BYTES = 16
_RANK = struct.Struct("!I")
_MAC_BYTES = hashlib.sha256().digest_size
_HEADER = struct.Struct("!Q")  # a message's payload size
# How long an admitted connection may take to answer the nonce: a member answers at once, and a
# connection that does not must not hold up the members queued behind it for long.
HANDSHAKE_TIMEOUT_S = 1.0
# While opening, how often a member looks again (for a peer's address, or whether to give up).
_POLL_S = (0.001, 0.02)
_SLICE_S = 0.1


class PeerLost(RuntimeError):
    """A member of the round closed its link, reset it, sent nothing for the collective timeout,
    or could not be linked to. A RuntimeError, as gloo's failed collectives are: the worker
    regroups."""


def local_address(host: str, port: int) -> str:
    """The address this machine uses to reach host:port (no packet is sent): the interface the
    round's peers, who reach the same master, can reach this worker on."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


def _proof(key: bytes, nonce: bytes, round_name: str, dialer: int, listener: int) -> bytes:
    message = nonce + round_name.encode() + _RANK.pack(dialer) + _RANK.pack(listener)
    return hmac.new(key, message, hashlib.sha256).digest()


class _Opening:
    """What one member's opening of its links needs to know: its round, rank and key, its
    deadline, and whether the master has moved on (a newer round: give up at once)."""

    def __init__(self, store, round_name: str, rank: int, world: int, key: bytes, timeout_s: float,
                 give_up: Callable[[], bool]):
        self.store, self.round_name, self.rank, self.world, self.key = store, round_name, rank, world, key
        self.deadline = time.monotonic() + timeout_s
        self.give_up = give_up

    def remaining(self, limit: float | None = None) -> float:
        """Seconds left, at most `limit`; PeerLost once none are, or once the master moved on."""
        if self.give_up():
            raise PeerLost(f"rank {self.rank} stopped opening its links: the master proposed a newer round")
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise PeerLost(f"rank {self.rank} could not link to every member of the round in time")
        return left if limit is None else min(left, limit)

    def address_of(self, listener: int) -> tuple[str, int]:
        key, pause = f"links/{listener}", _POLL_S[0]
        while not self.store.check([key]):
            time.sleep(self.remaining(pause))
            pause = min(2 * pause, _POLL_S[1])
        host, port = self.store.get(key).decode().split()
        return host, int(port)

    def read_exactly(self, sock: socket.socket, count: int, until: float | None = None) -> bytes:
        data = bytearray()
        while len(data) < count:
            limit = _SLICE_S if until is None else min(_SLICE_S, until - time.monotonic())
            if limit <= 0:
                raise TimeoutError("no answer to the handshake")
            sock.settimeout(self.remaining(limit))
            try:
                chunk = sock.recv(count - len(data))
            except TimeoutError:
                continue
            if not chunk:
                raise PeerLost("a peer closed its link while it was being opened")
            data += chunk
        return bytes(data)


class PeerLinks:
    """One connected socket per other rank of the round (rank -> socket)."""

    def __init__(self, peers: dict[int, socket.socket], timeout_s: float):
        self.peers = peers
        self.timeout_s = timeout_s
        self._poll = select.poll()  # not select(): it refuses descriptors past 1023
        self._polled: set[int] = set()
        for sock in peers.values():
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)

    @classmethod
    def open(cls, store, round_name: str, rank: int, world: int, host: str, key: bytes, timeout_s: float,
             give_up: Callable[[], bool] = lambda: False, exchange_timeout_s: float | None = None) -> PeerLinks:
        """Link this rank to every other: publish a listener in the round's store, dial each lower
        rank, admit each higher one. Every member calls this once its gloo group has started.
        `timeout_s` bounds the opening; each exchange then gets `exchange_timeout_s` (the same
        when not given)."""
        opening = _Opening(store, round_name, rank, world, key, timeout_s, give_up)
        peers: dict[int, socket.socket] = {}
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.create_server((host, 0), family=family) if rank < world - 1 else None
        try:
            if listener is not None:
                listener_host, port = listener.getsockname()[:2]
                store.set(f"links/{rank}", f"{listener_host} {port}")
            for lower in range(rank):
                peers[lower] = _dial(opening, lower)
            while len(peers) < world - 1:
                dialer, sock = _admit(opening, listener, taken=peers.keys())
                peers[dialer] = sock
        except BaseException as exc:
            for sock in peers.values():
                sock.close()
            if isinstance(exc, OSError):  # a member died since gloo's start: regroup, as for gloo's errors
                raise PeerLost(f"rank {rank} could not link to every other member of the round: {exc}") from None
            raise
        finally:
            if listener is not None:
                listener.close()
        return cls(peers, timeout_s if exchange_timeout_s is None else exchange_timeout_s)

    def exchange(self, sending: dict[int, np.ndarray], receiving: dict[int, np.ndarray]) -> None:
        """Send sending[peer] to every peer and fill receiving[peer] with what it sends, all at
        once (a send that waited for the peer's receive could wait for ever: both sides send
        first). Both are contiguous arrays, and the peer's message must be exactly the size of
        receiving[peer]. PeerLost when a peer is gone, or when the exchange has not finished
        within the timeout."""
        outgoing = {q: _Message([memoryview(_HEADER.pack(sending[q].nbytes)), memoryview(sending[q]).cast("B")])
                    for q in self.peers}
        incoming = {q: _Message([memoryview(bytearray(_HEADER.size)), memoryview(receiving[q]).cast("B")])
                    for q in self.peers}
        deadline = time.monotonic() + self.timeout_s
        while True:
            moved = False
            for q, sock in self.peers.items():
                moved |= _send_some(q, sock, outgoing[q])
                moved |= _receive_some(q, sock, incoming[q])
            if all(outgoing[q].done and incoming[q].done for q in self.peers):
                return
            if not moved:
                self._wait(outgoing, incoming, deadline)

    def _wait(self, outgoing: dict[int, _Message], incoming: dict[int, _Message], deadline: float) -> None:
        """Sleep until some link can move a byte; a peer that is done is not waited on (its
        closed socket would wake the wait at once, for ever)."""
        for q, sock in self.peers.items():
            mask = (0 if incoming[q].done else select.POLLIN) | (0 if outgoing[q].done else select.POLLOUT)
            fd = sock.fileno()
            if mask:
                self._poll.register(fd, mask)  # registering again changes the mask
                self._polled.add(fd)
            elif fd in self._polled:
                self._poll.unregister(fd)
                self._polled.discard(fd)
        left = deadline - time.monotonic()
        if left <= 0 or not self._poll.poll(left * 1000):
            raise PeerLost(f"the step's exchange did not finish in {self.timeout_s:.0f} s (a member hung)")

    def close(self) -> None:
        for sock in self.peers.values():
            sock.close()
        self.peers = {}


class _Message:
    """One direction of one link's message: its parts (header, payload) and how far it got."""

    def __init__(self, parts: list[memoryview]):
        self.parts = parts
        self.part, self.offset = 0, 0

    @property
    def done(self) -> bool:
        return self.part == len(self.parts)

    def rest(self) -> list[memoryview]:
        return [self.parts[self.part][self.offset:]] + self.parts[self.part + 1:]

    def advance(self, count: int) -> None:
        while count:
            step = min(count, self.parts[self.part].nbytes - self.offset)
            self.offset += step
            count -= step
            if self.offset == self.parts[self.part].nbytes:
                self.part, self.offset = self.part + 1, 0


def _send_some(q: int, sock: socket.socket, message: _Message) -> bool:
    if message.done:
        return False
    try:
        message.advance(sock.sendmsg(message.rest()))
        return True
    except (BlockingIOError, InterruptedError):
        return False
    except OSError as exc:
        raise PeerLost(f"the link to rank {q} failed ({exc}): it left or died") from None


def _receive_some(q: int, sock: socket.socket, message: _Message) -> bool:
    """Read what the link holds of `message`; its header must announce the payload it expects."""
    if message.done:
        return False
    try:
        count = sock.recvmsg_into(message.rest())[0]
    except (BlockingIOError, InterruptedError):
        return False
    except OSError as exc:
        raise PeerLost(f"the link to rank {q} failed ({exc}): it left or died") from None
    if count == 0:
        raise PeerLost(f"rank {q} closed its link (it left or died)")
    header_was_open = message.part == 0
    message.advance(count)
    if header_was_open and message.part > 0:
        (size,) = _HEADER.unpack(message.parts[0])
        expected = message.parts[1].nbytes
        if size != expected:
            raise PeerLost(f"rank {q} sent {size} bytes of the step buffer where this rank expects {expected}: "
                           "the ranks do not train the same model")
    return True


def _dial(opening: _Opening, listener: int) -> socket.socket:
    host, port = opening.address_of(listener)
    sock = socket.create_connection((host, port), timeout=opening.remaining(HANDSHAKE_TIMEOUT_S))
    try:
        nonce = opening.read_exactly(sock, _NONCE_BYTES)  # the listener may be admitting others first
        sock.sendall(_RANK.pack(opening.rank) + _proof(opening.key, nonce, opening.round_name, opening.rank, listener))
    except BaseException:
        sock.close()
        raise
    return sock


def _admit(opening: _Opening, listener: socket.socket, taken) -> tuple[int, socket.socket]:
    """The next higher rank that shows it holds the key; a connection that does not, or does
    not answer within HANDSHAKE_TIMEOUT_S, is closed and logged, and the wait goes on."""
    rank = opening.rank
    while True:
        listener.settimeout(opening.remaining(_SLICE_S))
        try:
            sock, address = listener.accept()
        except TimeoutError:
            continue
        try:
            nonce = os.urandom(_NONCE_BYTES)
            sock.settimeout(opening.remaining(HANDSHAKE_TIMEOUT_S))
            sock.sendall(nonce)
            claim = opening.read_exactly(sock, _RANK.size + _MAC_BYTES, until=time.monotonic() + HANDSHAKE_TIMEOUT_S)
        except (OSError, PeerLost) as exc:
            sock.close()
            if opening.give_up() or time.monotonic() > opening.deadline:
                raise
            log.warning("a link to rank %d from %s failed while opening: %s", rank, address, exc)
            continue
        except BaseException:
            sock.close()
            raise
        (dialer,) = _RANK.unpack(claim[:_RANK.size])
        proof = _proof(opening.key, nonce, opening.round_name, dialer, rank)
        if rank < dialer < opening.world and dialer not in taken and hmac.compare_digest(claim[_RANK.size:], proof):
            sock.settimeout(None)
            return dialer, sock
        log.warning("refused a link to rank %d from %s: it did not prove it holds the job's token for rank %d",
                    rank, address, dialer)
        sock.close()
