"""The API server's connections, guarded against clients that hold them without asking anything.

uvicorn answers 503 to every request once `limit_concurrency` connections are open, and it
closes a connection only after a response (keep-alive) or when the client does: a few hundred
sockets that never send a byte, which need no token, would make the master answer 503 to its
own workers until they are dropped as hung. Two guards keep the connections for the job:

- a request must arrive in time: its head within REQUEST_DEADLINE_S of the connection opening
  (or of the request's first byte, on a kept-alive connection), and its body without a pause
  that long. A connection that asks nothing is closed;
- one peer address holds at most `per_peer` connections: a connection beyond that is closed at
  once, so one host cannot take the server's whole limit. A peer is an address, so the limit is
  what the whole job may need (every worker of a local job, or every worker behind a sidecar
  proxy, comes from one address).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

REQUEST_DEADLINE_S = 5.0
# A worker holds up to five connections at once (main loop, task prefetch, heartbeat, step
# reports, checkpoint upload); the operator's CLI, `top` and the live page a few more.
CONNECTIONS_PER_WORKER = 5
OPERATOR_CONNECTIONS = 16


def per_peer_limit(workers: int) -> int:
    """The most connections one address may hold: as many as a job of `workers` workers
    (its spares included) and its operator could all open from one address."""
    return CONNECTIONS_PER_WORKER * workers + OPERATOR_CONNECTIONS


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the two guards above. `per_peer` and
    `request_deadline_s` are set on the subclass `guarded_protocol` makes for a server."""

    per_peer: int = per_peer_limit(1)
    request_deadline_s: float = REQUEST_DEADLINE_S
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        peer = self.client[0] if self.client else None
        if peer is not None and sum(1 for c in self.connections if getattr(c, "client", None) and c.client[0] == peer) > self.per_peer:
            transport.close()
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    # httptools' callbacks, in the order a request arrives
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self._arm()  # a large upload takes long, but keeps moving

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()  # the rest is the app's time, then uvicorn's keep-alive timeout

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.request_deadline_s, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if self.flow is not None and self.flow.read_paused:  # the app is behind the upload, not the client
            self._arm()
            return
        if not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(per_peer: int, request_deadline_s: float = REQUEST_DEADLINE_S) -> type[GuardedHttpProtocol]:
    """The protocol class for one server, with its limits."""
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,), {"per_peer": per_peer, "request_deadline_s": request_deadline_s})
