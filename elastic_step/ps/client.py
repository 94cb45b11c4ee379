"""PsClient: a worker's side of the shards: pull rows, push gradients merged per id.

Ids are deduplicated before they travel, in order of first appearance (so a push of the ids a
pull fetched reaches each shard in the pull's order, and the shard reuses the pull's slots:
table.py); a push sums the gradients of repeated ids. A request
goes to every shard that owns some of the ids at once (sent to all, then answered by all), over
one kept-open connection per shard.

Retries are what make a shard's death invisible to the worker: a connection that fails (the
shard was SIGKILLed, or is replaying its ledger) and a refusal for a stale routing epoch are
both answered by refreshing the routes and sending again, until `deadline_s`. The newest
routing wins among `routes()` (the master's view, with a relaunched shard's new address), the
routing a refusing shard sends with its refusal, and, after a connection failed and nothing
newer came, what the other shards it knows say is current: after `scale --ps` the workers learn
the shards' new routing from the shards themselves, however stale their job spec's is. A push is re-sent with the same
(task, batch_seq): a shard that applied it before it died has it in its snapshot or ledger and
acknowledges it without applying it again. A push refused by a rollback's fence (its round
began before the job went back to a checkpoint) is not retried: RoundFenced ends the round.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pandas

from elastic_step.ps import wire
from elastic_step.ps.api import RETRY_AFTER_REFRESH, PsError, RoundFenced, ShardUnavailable, Status
from elastic_step.ps.arrays import put_rows
from elastic_step.ps.routing import RoutingTable

# A connection to a live shard opens in milliseconds, or is refused at once while it relaunches.
# One that does not open within this is to an address nobody holds any more (a deleted pod's: its
# packets go nowhere, and no refusal comes back), and waiting the read timeout there held a worker
# for 30 s, a checkpoint's cut for 120 s, before it asked the routes again. Long enough for the
# kernel's first SYN retransmit (1 s) and its second (3 s) on a loaded node.
CONNECT_TIMEOUT_S = 3.5


@dataclass
class PushReply:
    applied: int = 0  # shards that applied the push now
    duplicate: int = 0  # shards that had applied it already (a re-sent or re-issued batch)
    retries: int = 0  # requests sent again after a failure or a stale epoch


class PsClient:
    def __init__(self, token: str, routes: Callable[[], RoutingTable], deadline_s: float = 60.0, timeout_s: float = 30.0):
        self.token = token
        self.routes = routes
        self.routing = routes()
        self.deadline_s = deadline_s
        self.timeout_s = timeout_s
        self.giving_up = False  # set by another thread: a call under way ends at its next retry
        self._connections: dict[str, socket.socket] = {}

    def pull(self, table: str, ids: np.ndarray) -> np.ndarray:
        """The rows of `ids` (len(ids) x dim), in the order given."""
        inverse, unique = _distinct(ids)
        gathered: np.ndarray | None = None

        def request(positions):
            return {"op": "pull", "table": table, "count": len(positions)}, (unique[positions],)

        for positions, (_, body) in self._each_shard(unique, request):
            rows = np.frombuffer(body, "<f4").reshape(len(positions), -1)
            if gathered is None:
                gathered = np.empty((len(unique), rows.shape[1]), np.float32)
            put_rows(gathered, positions, rows)
        if gathered is None:
            return np.zeros((0, 0), np.float32)
        return gathered if inverse is None else gathered[inverse]

    def push(self, table: str, task: int, batch_seq: int, attempt: int, ids: np.ndarray, grads: np.ndarray,
             step: int | None = None) -> PushReply:
        """Send one batch's gradients (summed per id) for the shards to apply once. `step`: the
        training step it belongs to, which tells a shard when a checkpoint's cut is due (cuts.py)."""
        inverse, unique = _distinct(ids)
        merged = np.asarray(grads, dtype=np.float32)
        if inverse is not None:  # the same id from several forwards: summed (np.add.at adds repeats, indexing would not)
            merged = np.zeros((len(unique), merged.shape[1]), np.float32)
            np.add.at(merged, inverse, grads)
        reply = PushReply()
        key = {"op": "push", "table": table, "task": int(task), "batch_seq": int(batch_seq), "attempt": int(attempt),
               "step": None if step is None else int(step)}

        def request(positions):
            return {**key, "count": len(positions)}, (unique[positions], merged[positions])

        for _, (header, _) in self._each_shard(unique, request, reply):
            if header["applied"]:
                reply.applied += 1
            else:
                reply.duplicate += 1
        return reply

    def call(self, endpoint: str, header: dict, *arrays: np.ndarray) -> tuple[dict, bytearray]:
        """One request to one shard, no retries (stats, digests, routing changes)."""
        sock = self._connection(endpoint)
        try:
            wire.send(sock, {**header, "token": self.token}, *arrays)
            return wire.receive(sock)
        except (OSError, wire.FrameError):
            self._drop(endpoint)
            raise

    def _each_shard(self, ids: np.ndarray, request: Callable, reply: PushReply | None = None):
        """Yield (positions in ids, (header, body)) once per shard that answered OK, retrying
        the rest after refreshing the routes until every id is answered or the deadline."""
        pending, answered = np.arange(len(ids)), np.zeros(len(ids), bool)
        deadline, backoff = time.monotonic() + self.deadline_s, 0.02
        while len(pending):
            sent, failed = self._send_parts(ids, pending, request)
            lost, newer = len(failed) > 0, []
            for positions, answer in self._answers(sent):
                if answer is not None and answer[0]["status"] == Status.OK:
                    if not answered[positions].all():  # else a part re-sent whole (below), known already
                        yield positions, answer
                    answered[positions] = True
                    continue
                failed.append(positions)
                lost |= answer is None
                if answer is not None and "routing" in answer[0]:
                    newer.append(RoutingTable.from_json(answer[0]["routing"]))
            if not failed:
                return
            pending = np.concatenate(failed)
            if reply is not None:
                reply.retries += len(failed)
            if time.monotonic() > deadline or self.giving_up:
                raise ShardUnavailable(f"{len(pending)} ids unanswered after {self.deadline_s:.0f} s; are the shards running?")
            time.sleep(backoff)  # a relaunched shard needs a moment to replay its ledger
            backoff = min(0.2, backoff * 2)  # a refused connection is cheap: look again soon
            epoch = self.routing.epoch
            self._refresh(newer, lost)
            if reply is not None and self.routing.epoch != epoch:
                # A push goes out whole again under a new routing: each shard's part then holds
                # every id of the push it owns, which a shard's applied keys rely on
                # (applied.py); the parts applied before are acknowledged as duplicates.
                pending = np.arange(len(ids))

    def _send_parts(self, ids: np.ndarray, pending: np.ndarray, request: Callable) -> tuple[list, list]:
        """Send each shard its part of ids[pending]: ([(endpoint, positions)] sent, [positions] not)."""
        shard_of = self.routing.shard_of(ids[pending])
        sent, failed = [], []
        for shard in range(self.routing.shards):
            positions = pending[shard_of == shard]
            if not len(positions):
                continue
            header, arrays = request(positions)
            endpoint = self.routing.endpoints[shard]
            try:
                wire.send(self._connection(endpoint), {**header, "token": self.token, "epoch": self.routing.epoch}, *arrays)
                sent.append((endpoint, positions))
            except OSError:
                self._drop(endpoint)
                failed.append(positions)
        return sent, failed

    def _answers(self, sent: list):
        """(positions, answer or None when the connection failed) for each part sent, in order."""
        for i, (endpoint, positions) in enumerate(sent):
            try:
                answer = self._answer(endpoint)
            except (PsError, RoundFenced):  # the replies not read yet would answer the next requests: drop them
                for unread, _ in sent[i + 1 :]:
                    self._drop(unread)
                raise
            yield positions, answer

    def _refresh(self, newer: list[RoutingTable], lost: bool) -> None:
        """The newest routing known: the master's, the refusals', else the other shards' word."""
        known = [self.routes(), *newer, self.routing]  # max() keeps the first of equal epochs: the master's
        if lost and max(r.epoch for r in known) == self.routing.epoch:
            known[1:1] = self._asked()
        self.routing = max(known, key=lambda r: r.epoch)

    def _asked(self) -> list[RoutingTable]:
        """The routing each reachable shard of the current routing holds."""
        found = []
        for endpoint in self.routing.endpoints:
            try:
                header, _ = self.call(endpoint, {"op": "routing"})
            except (OSError, wire.FrameError):
                continue
            if header.get("status") == Status.OK and "routing" in header:
                found.append(RoutingTable.from_json(header["routing"]))
        return found

    def _answer(self, endpoint: str) -> tuple[dict, bytearray] | None:
        try:
            header, body = wire.receive(self._connections[endpoint])
        except (OSError, wire.FrameError, KeyError):
            self._drop(endpoint)
            return None
        status = header.get("status")
        if status not in {s.value for s in Status}:
            raise PsError(f"shard {endpoint} answered an unknown status {status!r}")
        if status == Status.FENCED:
            raise RoundFenced(f"shard {endpoint}: {header.get('detail', 'the job rolled back past this round')}")
        if status != Status.OK and Status(status) not in RETRY_AFTER_REFRESH:
            raise PsError(f"shard {endpoint} refused the request ({status}): {header.get('detail', '')}")
        return header, body

    def _connection(self, endpoint: str) -> socket.socket:
        sock = self._connections.get(endpoint)
        if sock is None:
            host, port = endpoint.rsplit(":", 1)
            sock = socket.create_connection((host, int(port)), timeout=min(self.timeout_s, CONNECT_TIMEOUT_S))
            sock.settimeout(self.timeout_s)  # a shard's answer may take longer: a cut of large tables
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._connections[endpoint] = sock
        return sock

    def _drop(self, endpoint: str) -> None:
        sock = self._connections.pop(endpoint, None)
        if sock is not None:
            sock.close()

    def close(self) -> None:
        for endpoint in list(self._connections):
            self._drop(endpoint)


class PushQueue:
    """Pushes sent in order on their own connection and thread, so that a worker computes (and
    pulls) its next batch while the shards fsync the last one's ledger record; the shard's fsync
    runs outside its lock, so the pull is not held up by it. At most `depth` pushes wait;
    `wait()` returns once every submitted push is acknowledged. A push that fails for good is
    raised by the next submit or wait. A pull may not yet see the pushes still in the queue."""

    def __init__(self, client: PsClient, depth: int = 2):
        self.client = client  # its own PsClient: a connection carries one request at a time
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._send, name="ps-push", daemon=True)
        self.thread.start()

    def submit(self, table: str, task: int, batch_seq: int, attempt: int, ids: np.ndarray, grads: np.ndarray) -> None:
        self._raise()
        self.queue.put((table, task, batch_seq, attempt, ids, grads))

    def wait(self) -> None:
        self.queue.join()
        self._raise()

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()
        self.client.close()

    def _send(self) -> None:
        while (push := self.queue.get()) is not None:
            try:
                if self.error is None:
                    self.client.push(*push)
            except BaseException as exc:  # handed to the worker's thread by _raise
                self.error = exc
            finally:
                self.queue.task_done()
        self.queue.task_done()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error


def _distinct(ids: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
    """(each id's index among the distinct ids, or None when they are distinct already, as one
    forward's are; the distinct ids in order of first appearance). A hash table's factorize,
    about twice as fast as np.unique's sort on a batch's ids."""
    flat = np.asarray(ids, dtype=np.int64).reshape(-1)
    inverse, unique = pandas.factorize(flat)
    return (None if len(unique) == len(flat) else inverse), unique
