"""A TCP relay from one network namespace to another: how a pod on the cluster's own network
reaches a server on the node's loopback (the API server, S3, MLflow), and how the test reaches a
pod's port (`kubectl port-forward`). Nothing else crosses between the cluster's sandbox and the
node: no route, no interface, only the connections this process makes.

It listens in one namespace and connects in the other: a socket keeps the namespace it was made
in, so the listener is made after setns(2) into the listening side, then the thread switches to
the connecting side, where every later connection (and every thread) is made.

Usage: python netrelay.py LISTEN_NETNS LISTEN_HOST LISTEN_PORT CONNECT_NETNS CONNECT_HOST CONNECT_PORT
(NETNS: a name under /run/netns, or `-` for the node's own). It prints the port it listens on,
then relays until it is killed."""

import ctypes
import os
import socket
import sys
import threading

CLONE_NEWNET = 0x40000000
libc = ctypes.CDLL(None, use_errno=True)


def enter(netns: str, own: int) -> None:
    fd = own if netns == "-" else os.open(f"/run/netns/{netns}", os.O_RDONLY)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        sys.exit(f"netrelay: cannot enter network namespace {netns}: {os.strerror(ctypes.get_errno())}")


def pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(1 << 16):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock, how in ((sink, socket.SHUT_WR), (source, socket.SHUT_RD)):
            try:
                sock.shutdown(how)
            except OSError:
                pass


def relay(client: socket.socket, target: tuple[str, int]) -> None:
    try:
        upstream = socket.create_connection(target, timeout=10)
    except OSError:
        client.close()
        return
    upstream.settimeout(None)
    back = threading.Thread(target=pipe, args=(upstream, client), daemon=True)
    back.start()
    pipe(client, upstream)
    back.join()
    client.close()
    upstream.close()


def main(listen_ns: str, listen_host: str, listen_port: str, connect_ns: str, connect_host: str, connect_port: str) -> None:
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    enter(listen_ns, own)
    listener = socket.create_server((listen_host, int(listen_port)), family=socket.AF_INET6 if ":" in listen_host else socket.AF_INET,
                                    backlog=256)
    enter(connect_ns, own)
    print(listener.getsockname()[1], flush=True)
    target = (connect_host, int(connect_port))
    while True:
        client, _ = listener.accept()
        threading.Thread(target=relay, args=(client, target), daemon=True).start()


if __name__ == "__main__":
    main(*sys.argv[1:])
