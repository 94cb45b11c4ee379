"""The master's TCPStore, which hosts every round's rendezvous (the data plane's front door).

A TCPStore asked to listen on a host still binds every interface (it opens its own socket on
the wildcard address). The store has no authentication, so it is handed a socket the master
bound itself, on the API's host only; each round's keys live under a secret prefix that only the
authenticated rendezvous reply gives out (see membership.Round)."""

from __future__ import annotations

import socket


class RendezvousStore:
    """The master's side of the TCPStore, listening on `host` only (port 0: a free one)."""

    def __init__(self, host: str, port: int = 0):
        import torch.distributed as dist  # torch loads only where a store is needed

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.bind((host, port))
            listener.listen(256)
            self.store = dist.TCPStore(
                host, listener.getsockname()[1], is_master=True, wait_for_workers=False,
                master_listen_fd=listener.fileno(),
            )
        except BaseException:
            listener.close()
            raise
        listener.detach()  # the store serves on the descriptor now, and closes it when it goes
        self.host = host
        self.port = self.store.port

    def close(self) -> None:
        self.store = None
