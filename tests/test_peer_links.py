"""The round's peer links (worker/peer_links.py), over real sockets and the master's real TCPStore.

Contract: every pair of ranks gets one link, opened by the higher rank and admitted only when the
dialer proves it holds the job's key for this round; the exchange hands each rank every other
rank's bytes, whatever the buffer's size (both sides send first, so a buffer larger than the
sockets' buffers must not deadlock); a peer that dies fails the exchange at once and one that
stops sending fails it at the timeout, each as a PeerLost (a RuntimeError, which the worker answers
by regrouping)."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch.distributed as dist

from elastic_step.worker.peer_links import PeerLinks, PeerLost, _proof, local_address

KEY = b"the job's token"


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=20))
    yield master
    del master


def open_all(store, world: int, round_name: str = "round-1/", timeout_s: float = 10.0) -> list[PeerLinks]:
    links: list = [None] * world
    errors: list = []

    def open_one(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=20))
        try:
            links[rank] = PeerLinks.open(dist.PrefixStore(round_name, client), round_name, rank, world, "127.0.0.1", KEY, timeout_s)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=open_one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return links


def exchange_all(links: list[PeerLinks], size: int) -> list[dict[int, np.ndarray]]:
    world = len(links)
    mine = [np.full(size, rank + 1, dtype=np.float32) for rank in range(world)]
    received = [{q: np.zeros(size, dtype=np.float32) for q in range(world) if q != rank} for rank in range(world)]
    threads = [threading.Thread(target=links[r].exchange, args=({q: mine[r] for q in received[r]}, received[r]))
               for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return received


@pytest.mark.parametrize("world, size", [(2, 17_000), (3, 17_000), (3, 4_000_000)])
def test_every_rank_receives_every_other_ranks_buffer(store, world, size):
    links = open_all(store, world)
    try:
        # 4M floats is 16 MB a link: far past what the sockets buffer, so both directions must move at once.
        for _ in range(2):
            for rank, received in enumerate(exchange_all(links, size)):
                assert sorted(received) == [q for q in range(world) if q != rank]
                for q, data in received.items():
                    assert (data == q + 1).all(), f"rank {rank} got a wrong buffer from rank {q}"
    finally:
        for link in links:
            link.close()


def test_a_dialer_without_the_key_is_refused_and_the_real_rank_still_links(store, caplog):
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    prefix = dist.PrefixStore("round-7/", client)
    result: dict = {}
    rank0 = threading.Thread(target=lambda: result.update(
        links=PeerLinks.open(prefix, "round-7/", 0, 2, "127.0.0.1", KEY, 10.0)))
    rank0.start()
    observer = dist.PrefixStore("round-7/", store)
    observer.wait(["links/0"], datetime.timedelta(seconds=10))
    host, port = observer.get("links/0").decode().split()
    # An intruder claims rank 1: with a wrong key, then with a proof made for another round.
    for key, round_name in ((b"a guess", "round-7/"), (KEY, "round-6/")):
        with socket.create_connection((host, int(port)), timeout=5) as intruder:
            nonce = intruder.recv(16)
            intruder.sendall((1).to_bytes(4, "big") + _proof(key, nonce, round_name, 1, 0))
            assert intruder.recv(1) == b"", "the listener should close an unproven link"
    real = PeerLinks.open(dist.PrefixStore("round-7/", dist.TCPStore("127.0.0.1", store.port, is_master=False)),
                          "round-7/", 1, 2, "127.0.0.1", KEY, 10.0)
    rank0.join(10)
    try:
        received = exchange_all([result["links"], real], 100)
        assert (received[0][1] == 2).all() and (received[1][0] == 1).all()
        assert caplog.text.count("did not prove it holds the job's token") == 2
    finally:
        result["links"].close()
        real.close()


_PEER = """
import datetime, sys, time, numpy as np, torch.distributed as dist
from elastic_step.worker.peer_links import PeerLinks
client = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False)
links = PeerLinks.open(dist.PrefixStore("r/", client), "r/", 1, 2, "127.0.0.1", b"the job's token", 10.0)
links.exchange({0: np.ones(1000, np.float32)}, {0: np.empty(1000, np.float32)})
print("exchanged", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_dead_peer_fails_the_exchange_at_once_and_a_hung_one_at_the_timeout(store, how):
    peer = subprocess.Popen([sys.executable, "-c", _PEER, str(store.port)], stdout=subprocess.PIPE, text=True)
    try:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
        links = PeerLinks.open(dist.PrefixStore("r/", client), "r/", 0, 2, "127.0.0.1", KEY, 10.0)
        links.timeout_s = 2.0
        links.exchange({1: np.ones(1000, np.float32)}, {1: np.empty(1000, np.float32)})
        assert peer.stdout.readline().strip() == "exchanged"
        os.kill(peer.pid, getattr(signal, how))
        started = time.monotonic()
        with pytest.raises(PeerLost, match=r"rank 1 (closed its link|failed).*left or died" if how == "SIGKILL" else "did not finish in 2 s"):
            links.exchange({1: np.ones(1000, np.float32)}, {1: np.empty(1000, np.float32)})
        took = time.monotonic() - started
        assert took < 1.0 if how == "SIGKILL" else 1.9 < took < 5.0
        assert isinstance(PeerLost("x"), RuntimeError)  # what the worker regroups on
        links.close()
    finally:
        peer.kill()
        peer.wait()


def test_a_member_whose_listener_is_gone_fails_the_opening_as_a_peer_lost(store):
    gone = socket.create_server(("127.0.0.1", 0))
    port = gone.getsockname()[1]
    gone.close()  # rank 0 published its listener, then died
    prefix = dist.PrefixStore("round-3/", dist.TCPStore("127.0.0.1", store.port, is_master=False))
    prefix.set("links/0", f"127.0.0.1 {port}")
    started = time.monotonic()
    with pytest.raises(PeerLost, match="rank 1 could not link"):
        PeerLinks.open(prefix, "round-3/", 1, 2, "127.0.0.1", KEY, 10.0)
    assert time.monotonic() - started < 2.0


def test_links_with_tiny_socket_buffers_still_move_a_large_step_both_ways_at_once():
    """Both sides send first: with buffers far smaller than the step, each side's send blocks
    while the peer's bytes wait to be read, and the exchange must keep reading (a path between
    nodes, whose buffers grow only as they are read, behaves so)."""
    def small(sock: socket.socket) -> socket.socket:  # before connecting: TCP sizes its window from them
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        return sock

    listener = small(socket.socket())
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    b = small(socket.socket())
    b.connect(listener.getsockname())
    a = listener.accept()[0]
    listener.close()
    links = [PeerLinks({1: a}, timeout_s=10.0), PeerLinks({0: b}, timeout_s=10.0)]
    try:
        started = time.monotonic()
        received = exchange_all(links, 1_000_000)
        assert (received[0][1] == 2).all() and (received[1][0] == 1).all()
        assert time.monotonic() - started < 5.0
    finally:
        for link in links:
            link.close()


def test_ranks_that_disagree_on_the_buffer_fail_loudly_not_out_of_step(store):
    links = open_all(store, 2)
    errors: list = []

    def one(rank: int, size: int) -> None:
        try:
            links[rank].exchange({1 - rank: np.ones(size, np.float32)}, {1 - rank: np.empty(size, np.float32)})
        except PeerLost as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=one, args=(0, 1000)), threading.Thread(target=one, args=(1, 1001))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for link in links:
        link.close()
    assert any("sent 4004 bytes of the step buffer where this rank expects 4000" in e for e in errors), errors


def test_a_connection_that_never_answers_the_nonce_does_not_keep_the_real_rank_out(store, caplog):
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    result: dict = {}
    rank0 = threading.Thread(target=lambda: result.update(
        links=PeerLinks.open(dist.PrefixStore("round-8/", client), "round-8/", 0, 2, "127.0.0.1", KEY, 10.0)))
    rank0.start()
    observer = dist.PrefixStore("round-8/", store)
    observer.wait(["links/0"], datetime.timedelta(seconds=10))
    host, port = observer.get("links/0").decode().split()
    silent = socket.create_connection((host, int(port)), timeout=5)  # connects first, then says nothing
    started = time.monotonic()
    real = PeerLinks.open(dist.PrefixStore("round-8/", dist.TCPStore("127.0.0.1", store.port, is_master=False)),
                          "round-8/", 1, 2, "127.0.0.1", KEY, 10.0)
    rank0.join(10)
    try:
        assert time.monotonic() - started < 4.0
        received = exchange_all([result["links"], real], 10)
        assert (received[0][1] == 2).all()
        assert "failed while opening" in caplog.text
    finally:
        silent.close()
        result["links"].close()
        real.close()


def test_a_member_that_waits_for_a_peer_gives_up_once_the_master_moves_on(store):
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    moved_on = time.monotonic() + 0.3
    for rank in (0, 1):  # rank 0 waits to admit rank 1; rank 1 waits for rank 0's address
        started = time.monotonic()
        with pytest.raises(PeerLost, match="the master proposed a newer round"):
            PeerLinks.open(dist.PrefixStore(f"round-{9 + rank}/", client), f"round-{9 + rank}/", rank, 2, "127.0.0.1", KEY,
                           10.0, give_up=lambda: time.monotonic() > moved_on)
        assert time.monotonic() - started < 1.5
        moved_on = time.monotonic() + 0.3


def test_links_past_descriptor_1023_exchange(store):
    """select() refuses descriptors past 1023; a worker with many files open gets such sockets."""
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        links = open_all(store, 2)
        assert min(s.fileno() for link in links for s in link.peers.values()) > 1023
        received = exchange_all(links, 1000)
        assert (received[0][1] == 2).all() and (received[1][0] == 1).all()
        for link in links:
            link.close()
    finally:
        for fd in filler:
            os.close(fd)


_STALLED_PEER = """
import sys, time, numpy as np, torch.distributed as dist
from elastic_step.worker.peer_links import PeerLinks, _HEADER
client = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False)
links = PeerLinks.open(dist.PrefixStore("s/", client), "s/", 1, 2, "127.0.0.1", b"the job's token", 10.0)
sock = links.peers[0]
sock.setblocking(True)
sock.sendall(_HEADER.pack(16_000_000) + bytes(1_000_000))  # a sixteenth of its step, then it stalls
print("stalled", flush=True)
time.sleep(600)
"""


def test_a_peer_that_stalls_mid_step_fails_the_exchange_at_the_timeout_without_spinning(store):
    import resource

    peer = subprocess.Popen([sys.executable, "-c", _STALLED_PEER, str(store.port)], stdout=subprocess.PIPE, text=True)
    try:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
        links = PeerLinks.open(dist.PrefixStore("s/", client), "s/", 0, 2, "127.0.0.1", KEY, 10.0)
        links.timeout_s = 2.0
        assert peer.stdout.readline().strip() == "stalled"
        cpu_before, started = resource.getrusage(resource.RUSAGE_SELF).ru_utime, time.monotonic()
        with pytest.raises(PeerLost, match="did not finish in 2 s"):
            links.exchange({1: np.ones(4_000_000, np.float32)}, {1: np.empty(4_000_000, np.float32)})
        assert 1.9 < time.monotonic() - started < 4.0
        assert resource.getrusage(resource.RUSAGE_SELF).ru_utime - cpu_before < 1.0, "the wait spun"
        links.close()
    finally:
        peer.kill()
        peer.wait()


def test_the_links_listen_on_the_address_that_reaches_the_master():
    assert local_address("127.0.0.1", 29500) == "127.0.0.1"
