"""Membership events (joined, left, died, dropped, regrouped, recovered, relaunched), kept in
memory for /status and appended to JOB_DIR/events.jsonl for people and MLflow."""

from __future__ import annotations

import json
import logging
import threading
import time

log = logging.getLogger("elastic_step.master")


class EventLog:
    def __init__(self, path: str | None, listener=None):
        self.path = path
        self.listener = listener  # called with each event (tracking)
        self.events: list[dict] = []
        self._lock = threading.Lock()

    def add(self, event: str, message: str = "", **fields) -> dict:
        record = {"time": time.time(), "event": event, **fields}
        if message:
            record["message"] = message
        with self._lock:
            self.events.append(record)
            if self.path:
                with open(self.path, "a", encoding="utf-8") as out:
                    out.write(json.dumps(record) + "\n")
        log.info("%s %s", event, message or json.dumps(fields))
        if self.listener is not None:
            self.listener(record)
        return record

    def of(self, event: str) -> list[dict]:
        with self._lock:
            return [e for e in self.events if e["event"] == event]


class StepLog:
    """Per-step metrics (loss, samples, samples/s, world size, round) as JSON lines in
    JOB_DIR/metrics.jsonl: what the benchmarks read, and what tracking uploads."""

    def __init__(self, path: str, listener=None):
        self._out = open(path, "a", encoding="utf-8")
        self._last_time: float | None = None
        self.listener = listener  # called with each entry (tracking)

    def add(self, record, world_size: int, round_id: int) -> None:
        rate = record.samples / (record.time - self._last_time) if self._last_time and record.time > self._last_time else None
        self._last_time = record.time
        entry = {
            "step": record.step, "time": record.time, "samples": record.samples,
            "loss": record.loss / max(record.samples, 1), "samples_per_s": rate,
            "world_size": world_size, "round": round_id,
        }
        self._out.write(json.dumps(entry) + "\n")
        if self.listener is not None:
            self.listener(entry)

    def close(self) -> None:
        self._out.close()
