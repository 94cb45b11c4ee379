"""A TCP connection to every other member of a round, over which the step buffer's direct
exchange runs: each step, one send and one receive per peer, and nothing in between.

gloo's point-to-point send and receive of the same buffer cost about 0.3-0.4 ms of CPU on each
side (its device thread, its queues and the wake-ups between them), a tenth of a small model's
step; a socket's send and receive cost about 0.06 ms (benchmarks/README.md). gloo's group is kept
for everything else: state sharing, the identity check, the ring for large buffers.

A link is opened by the higher rank, bound to the address this worker uses to reach the master
(the pod's own address, or loopback on one machine), and admitted only with proof that the dialer
holds the job's token: the listener sends a fresh nonce, the dialer answers with its rank and an
HMAC of the nonce, the round and both ranks under the token. gloo's own connections have no
such check; the job's NetworkPolicy is the only fence around them.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import os
import select
import socket
import struct
import time

import numpy as np

log = logging.getLogger("elastic_step.worker")

_NONCE_BYTES = 16
_RANK = struct.Struct("!I")
_MAC_BYTES = hashlib.sha256().digest_size


class PeerLost(RuntimeError):
    """A member of the round closed its link, reset it, or sent nothing for the collective
    timeout. A RuntimeError, as gloo's failed collectives are: the worker regroups."""


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


def _read_exactly(sock: socket.socket, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise PeerLost("a peer closed its link while it was being opened")
        data += chunk
    return bytes(data)


class PeerLinks:
    """One connected socket per other rank of the round (rank -> socket)."""

    def __init__(self, peers: dict[int, socket.socket], timeout_s: float):
        self.peers = peers
        self.timeout_s = timeout_s
        for sock in peers.values():
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)

    @classmethod
    def open(cls, store, round_name: str, rank: int, world: int, host: str, key: bytes, timeout_s: float) -> PeerLinks:
        """Link this rank to every other: publish a listener in the round's store, dial each lower
        rank, admit each higher one. Every member calls this once its gloo group has started."""
        deadline = time.monotonic() + timeout_s
        peers: dict[int, socket.socket] = {}
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.create_server((host, 0), family=family) if rank < world - 1 else None
        try:
            if listener is not None:
                listener_host, port = listener.getsockname()[:2]
                store.set(f"links/{rank}", f"{listener_host} {port}")
            for lower in range(rank):
                peers[lower] = _dial(store, round_name, lower, rank, key, deadline)
            while len(peers) < world - 1:
                dialer, sock = _admit(listener, round_name, rank, world, key, deadline, taken=peers.keys())
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
        return cls(peers, timeout_s)

    def exchange(self, mine: np.ndarray, received: dict[int, np.ndarray]) -> None:
        """Send `mine` to every peer and fill received[peer] with theirs, all at once (a send
        that waited for the peer's receive could wait for ever: both sides send first)."""
        outgoing = memoryview(mine).cast("B")
        total = outgoing.nbytes
        sent = {q: 0 for q in self.peers}
        got = {q: 0 for q in self.peers}
        incoming = {q: memoryview(received[q]).cast("B") for q in self.peers}
        while True:
            moved = False
            for q, sock in self.peers.items():
                try:
                    if sent[q] < total:
                        n = sock.send(outgoing[sent[q]:])
                        sent[q], moved = sent[q] + n, True
                    if got[q] < total:
                        n = sock.recv_into(incoming[q][got[q]:])
                        if n == 0:
                            raise PeerLost(f"rank {q} closed its link (it left or died)")
                        got[q], moved = got[q] + n, True
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as exc:
                    raise PeerLost(f"the link to rank {q} failed ({exc}): it left or died") from None
            if all(got[q] == total and sent[q] == total for q in self.peers):
                return
            if not moved:
                self._wait(sent, got, total)

    def _wait(self, sent: dict[int, int], got: dict[int, int], total: int) -> None:
        readable = [s for q, s in self.peers.items() if got[q] < total]
        writable = [s for q, s in self.peers.items() if sent[q] < total]
        ready = select.select(readable, writable, [], self.timeout_s)
        if not ready[0] and not ready[1]:
            raise PeerLost(f"no peer sent or took a byte of the step for {self.timeout_s:.0f} s (a member hung)")

    def close(self) -> None:
        for sock in self.peers.values():
            sock.close()
        self.peers = {}


def _dial(store, round_name: str, listener: int, rank: int, key: bytes, deadline: float) -> socket.socket:
    remaining = max(deadline - time.monotonic(), 0.001)
    store.wait([f"links/{listener}"], datetime.timedelta(seconds=remaining))
    host, port = store.get(f"links/{listener}").decode().split()
    sock = socket.create_connection((host, int(port)), timeout=max(deadline - time.monotonic(), 0.001))
    try:
        nonce = _read_exactly(sock, _NONCE_BYTES)
        sock.sendall(_RANK.pack(rank) + _proof(key, nonce, round_name, rank, listener))
    except BaseException:
        sock.close()
        raise
    return sock


def _admit(listener: socket.socket, round_name: str, rank: int, world: int, key: bytes, deadline: float,
           taken) -> tuple[int, socket.socket]:
    """The next higher rank that proves it holds the key; a connection that does not is closed
    and logged, and the wait goes on until the deadline."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise PeerLost(f"not every higher rank linked to rank {rank} in time")
        listener.settimeout(remaining)
        try:
            sock, address = listener.accept()
        except TimeoutError:
            continue
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            nonce = os.urandom(_NONCE_BYTES)
            sock.sendall(nonce)
            claim = _read_exactly(sock, _RANK.size + _MAC_BYTES)
        except (OSError, PeerLost) as exc:
            log.warning("a link to rank %d from %s failed while opening: %s", rank, address, exc)
            sock.close()
            continue
        (dialer,) = _RANK.unpack(claim[:_RANK.size])
        valid_rank = rank < dialer < world and dialer not in taken
        if valid_rank and hmac.compare_digest(claim[_RANK.size:], _proof(key, nonce, round_name, dialer, rank)):
            sock.settimeout(None)
            return dialer, sock
        log.warning("refused a link to rank %d from %s: it did not prove it holds the job's token for rank %d",
                    rank, address, dialer)
        sock.close()
