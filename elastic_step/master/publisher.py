"""The job's status, pushed every few seconds to where the backend's users read it, and the
operator's requests found there taken in.

On Kubernetes that is a ConfigMap read with the operator's own credentials: the master's port
admits only the job's worker pods (its NetworkPolicy), so `get`, `top` and `stop` from outside
the job cannot call the master. The publishing runs on its own thread: an API server that stalls
delays what others see, never the master's loop or its lock."""

from __future__ import annotations

import json
import logging
import threading

from elastic_step.backends.api import Backend
from elastic_step.master.events import EventLog

log = logging.getLogger("elastic_step.master")

PUBLISH_INTERVAL_S = 2.0
PUBLISHED_EVENTS = 300  # the newest events only: a ConfigMap holds at most 1 MiB
PUBLISHED_HISTORY = 300  # points of loss, samples/s and world size over time, evenly thinned
PS_ANSWERS_KEPT = 4  # the answers to the newest scale --ps requests, published together
# The document's own cap, in bytes of JSON: a ConfigMap holds at most 1 MiB with its metadata, and
# a larger document makes every update fail (300 events of 4 KB each are more), which would also
# hide the operator's stop annotation, read from the update's reply.
MAX_DOCUMENT_BYTES = 900 * 1024


def size_of(document: dict) -> int:
    return len(json.dumps(document, default=str).encode())


def within(document: dict, limit: int = MAX_DOCUMENT_BYTES) -> dict:
    """`document` cut to `limit` bytes: its oldest events go first, then every other history
    point (the newest always stays). What is left out is still in the job's events.jsonl, its
    MLflow run and its master's log."""
    document = {**document, "events": list(document.get("events", [])), "history": list(document.get("history", []))}
    while size_of(document) > limit and document["events"]:
        document["events"] = document["events"][max(1, len(document["events"]) // 8):]
    while size_of(document) > limit and len(document["history"]) > 1:
        document["history"] = document["history"][::-2][::-1]
    return document


class StatusPublisher:
    def __init__(self, state, backend: Backend, events: EventLog, info: dict, interval_s: float = PUBLISH_INTERVAL_S):
        self.state = state  # MasterState: status() and request_stop() take its lock themselves
        self.backend = backend
        self.events = events
        self.info = info  # what does not change: job, backend, start time, MLflow run
        self.interval_s = interval_s
        self.stop_taken = False
        self.stop_refused = ""  # why a requested stop cannot be done, for the operator's `stop`
        self.workers_taken: str | None = None  # the operator's last `scale` request taken in
        self.ps_taken: str | None = None  # the operator's last `scale --ps` request taken in
        # The answers of the last few requests, published for the operator's `scale --ps` to wait
        # on: {"request", "shards"} while the rows move, then with "moved" (what moved) or
        # "refused" (why not). Several: a second request refused while the first moves must not
        # take the first one's answer from its operator.
        self.ps_scales: dict[str, dict] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="status-publisher", daemon=True)

    def start(self) -> "StatusPublisher":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self.publish_once()
            except Exception:  # a bug here must not end the job; it is logged where people look
                log.exception("publishing the job's status failed")
            self._stopping.wait(self.interval_s)

    def publish_once(self) -> None:
        events, count = self.events.since(0)
        history = self.state.step_log.history() if self.state.step_log is not None else []
        stride = -(-len(history) // PUBLISHED_HISTORY) or 1
        document = {"info": self.info, "status": self.state.status(), "events": events[-PUBLISHED_EVENTS:],
                    "events_next": count, "history": history[::-stride][::-1]}  # the newest point always
        if self.stop_refused:
            document["stop_refused"] = self.stop_refused
        if self.ps_scales:
            document["ps_scales"] = list(self.ps_scales.values())
        requests = self.backend.publish(within(document))
        if "stop" in requests and not self.stop_taken:
            self.stop_taken = True  # the annotation stays; one request is enough
            try:
                self.state.request_stop()
                log.info("stop requested by the operator (the job's status ConfigMap)")
            except ValueError as exc:  # the job has ended, or it takes no checkpoints
                self.stop_refused = str(exc)
                log.warning("the operator asked for a stop, which cannot be done: %s", exc)
        if requests.get("workers") not in (None, self.workers_taken):
            self._scale(requests["workers"])
        if requests.get("ps_shards") not in (None, self.ps_taken):
            self._scale_ps(requests["ps_shards"])

    def _scale(self, requested: str) -> None:
        """The operator's `scale`: taken once per value (the annotation stays until the next)."""
        self.workers_taken = requested
        try:
            self.state.scale(int(requested))
            log.info("scaled to %s workers by the operator (the job's status ConfigMap)", requested)
        except ValueError as exc:  # not a number, outside the job's range, or the job has ended
            log.warning("the operator asked for %r workers, which cannot be done: %s", requested, exc)

    def _scale_ps(self, requested: str) -> None:
        """The operator's `scale --ps` ("SHARDS/REQUEST"), taken once per request. The rows move on
        a thread of their own: a move takes a while, and the status goes on being published meanwhile."""
        self.ps_taken = requested
        count, _, request = requested.partition("/")
        self.ps_scales[request] = {"request": request, "shards": count}
        while len(self.ps_scales) > PS_ANSWERS_KEPT:
            del self.ps_scales[next(iter(self.ps_scales))]
        monitor = self.state.ps_shards  # master/ps_monitor.py's ShardMonitor; None unless --mode ps
        if monitor is None:
            self._ps_answer(request, refused="this job has no parameter-server shards: scale --ps is for a --mode ps job")
        elif not count.isdigit():
            self._ps_answer(request, refused=f"{count!r} is not a number of shards")
        else:
            threading.Thread(target=self._move, args=(monitor, int(count), request), name="ps-scale", daemon=True).start()

    def _move(self, monitor, shards: int, request: str) -> None:
        try:
            moved = monitor.scale(shards)
        except ValueError as exc:  # the same count, a shard down, another scale under way, the job ending
            self._ps_answer(request, refused=str(exc))
            return
        except Exception as exc:  # a bug: logged with its trace, and the operator is not left waiting
            log.exception("scaling the parameter-server shards failed")
            self._ps_answer(request, refused=f"the move failed ({type(exc).__name__}: {exc}); see the master's log")
            return
        log.info("scaled to %d parameter-server shards by the operator (the job's status ConfigMap)", shards)
        self._ps_answer(request, moved=moved)

    def _ps_answer(self, request: str, **answer) -> None:
        if "refused" in answer:
            log.warning("the operator asked for other parameter-server shards, which cannot be done: %s", answer["refused"])
        asked = self.ps_scales.get(request)
        if asked is not None:  # a new dict, not a change of the one being published
            self.ps_scales[request] = {**asked, **answer}
