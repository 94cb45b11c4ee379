"""Membership events (joined, left, died, dropped, regrouped, recovered, relaunched), kept in
memory for /status and appended to JOB_DIR/events.jsonl for people and MLflow."""

from __future__ import annotations

import json
import logging
import threading
import time

from elastic_step.defaults import LOG_FORMAT
from elastic_step.protocol import EventKind

log = logging.getLogger("elastic_step.master")
# What a person reading the job's log (`kubectl logs`, the KFP UI, a terminal) needs without -v:
# the group changed, or the job was stopped or preempted. Routine events (a launch, a join, a round
# proposed, a checkpoint) are -v's; how the job ended, the command's own last lines say.
notable_log = logging.getLogger("elastic_step.events")
NOTABLE = frozenset({
    EventKind.DIED, EventKind.DROPPED, EventKind.RELAUNCHED, EventKind.NOT_RELAUNCHED, EventKind.SLOT_EXHAUSTED,
    EventKind.LEFT, EventKind.SCALED, EventKind.PS_SCALE_STARTED, EventKind.PS_SCALE_FINISHED,
    EventKind.REGROUPED, EventKind.RECOVERED, EventKind.RESTORED, EventKind.MASTER_PAUSED, EventKind.STOP_REQUESTED,
    EventKind.STOPPED, EventKind.PREEMPTED,
})


def show_notable_events() -> None:
    """Let the notable events into the job's log (stderr) at any log level: a step pod's log then
    says why its group changed. A level the caller set on the logger stays."""
    if notable_log.level == logging.NOTSET:
        notable_log.setLevel(logging.INFO)
    if not logging.getLogger().handlers and not notable_log.handlers:  # a process that configured no logging
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        notable_log.addHandler(handler)
        notable_log.propagate = False  # one line each, should the process configure logging later


class EventLog:
    def __init__(self, path: str | None, listener=None):
        self.path = path
        self.listener = listener  # called with each event (tracking)
        self.events: list[dict] = []
        self._lock = threading.Lock()

    def add(self, event: EventKind, message: str = "", **fields) -> dict:
        """Record an event and write it now."""
        record = self.record(event, message, **fields)
        self.write(record)
        return record

    def record(self, event: EventKind, message: str = "", **fields) -> dict:
        """Keep an event in memory (for /status and /events) without writing it; `write` does
        that, where the master's lock is not held."""
        # Every kind is one protocol.EventKind names (an undeclared one is a bug: ValueError),
        # kept in the record as its plain name.
        record = {"time": time.time(), "event": EventKind(event).value, **fields}
        if message:
            record["message"] = message
        with self._lock:
            self.events.append(record)
        return record

    def write(self, record: dict) -> None:
        """Append a recorded event to events.jsonl, log it, and tell the listener."""
        if self.path:
            with open(self.path, "a", encoding="utf-8") as out:
                out.write(json.dumps(record) + "\n")
        fields = {k: v for k, v in record.items() if k not in ("time", "event", "message")}
        logger = notable_log if record["event"] in NOTABLE else log
        logger.info("%s %s", record["event"], record.get("message") or json.dumps(fields))
        if self.listener is not None:
            self.listener(record)

    def of(self, event: str) -> list[dict]:
        with self._lock:
            return [e for e in self.events if e["event"] == event]

    def since(self, index: int) -> tuple[list[dict], int]:
        """The events from position `index` on, and the position after the last (for the next
        call). Under this log's own lock, never the master's."""
        with self._lock:
            return self.events[index:], len(self.events)


# Points the live page's history keeps: when full, every other point goes (so a long job keeps
# its whole span at a coarser grain, and a reply stays small).
HISTORY_POINTS = 2000


class StepLog:
    """Per-step metrics (loss, samples, samples/s, world size, round) as JSON lines in
    JOB_DIR/metrics.jsonl: what the benchmarks read, and what tracking uploads."""

    def __init__(self, path: str | None, listener=None):
        self._out = open(path, "a", encoding="utf-8") if path else None
        self._last_time: float | None = None
        self.listener = listener  # called with each entry (tracking)
        self._history: list[dict] = []
        self._stride = 1  # every how many steps the history keeps one
        self._lock = threading.Lock()

    def add(self, record, world_size: int, round_id: int) -> None:
        rate = record.samples / (record.time - self._last_time) if self._last_time and record.time > self._last_time else None
        self._last_time = record.time
        entry = {
            "step": record.step, "time": record.time, "samples": record.samples,
            "loss": record.loss / max(record.samples, 1), "samples_per_s": rate,
            "world_size": world_size, "round": round_id,
        }
        if record.passes_again:  # float16's overflows: absent, as from every fp32 and bf16 step, is none
            entry["passes_again"] = record.passes_again
        if self._out is not None:
            self._out.write(json.dumps(entry) + "\n")
        self._remember(entry)
        if self.listener is not None:
            self.listener(entry)

    def _remember(self, entry: dict) -> None:
        if entry["step"] % self._stride and entry["world_size"] == (self._history[-1]["world_size"] if self._history else None):
            return  # between kept points (a change of world size is always kept)
        with self._lock:
            self._history.append({k: entry[k] for k in ("step", "time", "loss", "samples_per_s", "world_size", "round")})
            if len(self._history) > HISTORY_POINTS:
                self._stride *= 2
                self._history = self._history[::2]

    def history(self) -> list[dict]:
        """Loss, samples/s and world size over time (a copy), for the live page."""
        with self._lock:
            return list(self._history)

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
