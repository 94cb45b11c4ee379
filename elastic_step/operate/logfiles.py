"""A job's log files: JOB_DIR/logs/master.log and one file per worker attempt
(JOB_DIR/logs/w<slot>.<attempt>.log). Which file a request means, and its lines filtered by age
and count, and followed while the job runs."""

from __future__ import annotations

import datetime
import os
import re
import time
from typing import Iterator

from elastic_step.errors import ElasticStepError

LINE_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?:[,.](\d{1,6}))?")
DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class NoSuchLog(ElasticStepError):
    """The log asked for does not exist (yet)."""


def parse_since(text: str) -> float:
    """'90s', '5m', '2h', '1d' in seconds."""
    match = DURATION.match(text.strip())
    if not match:
        raise NoSuchLog(f"--since {text!r} is not a duration; write it like 30s, 5m, 2h or 1d")
    return float(match.group(1)) * UNITS[match.group(2)]


def attempts(log_dir: str) -> dict[int, list[str]]:
    """Worker ids with a log file, by slot, oldest attempt first."""
    found: dict[int, list[tuple[int, str]]] = {}
    for name in os.listdir(log_dir) if os.path.isdir(log_dir) else []:
        match = re.match(r"^w(\d+)\.(\d+)\.log$", name)
        if match:
            found.setdefault(int(match.group(1)), []).append((int(match.group(2)), name[:-4]))
    return {slot: [w for _, w in sorted(ids)] for slot, ids in found.items()}


def log_path(job_dir: str, worker: str | None, master: bool, previous: bool) -> str:
    """The file of the master, or of a worker: `w1.2` (that attempt), `w1` or `1` (the slot's
    newest attempt); `previous`: the attempt before it (a relaunched slot's earlier life)."""
    log_dir = os.path.join(job_dir, "logs")
    if master or worker is None:
        if previous:
            raise NoSuchLog("--previous is for a worker's earlier attempt; the master has one log")
        path = os.path.join(log_dir, "master.log")
        if not os.path.exists(path):
            raise NoSuchLog(f"{path} does not exist: the job's master has not started (or is older than its log file)")
        return path
    by_slot = attempts(log_dir)
    match = re.match(r"^w?(\d+)(?:\.(\d+))?$", worker)
    if not match:
        raise NoSuchLog(f"--worker {worker!r} names no worker; use an id from `elastic-step get` (w1.2) or a slot (w1)")
    slot = int(match.group(1))
    ids = by_slot.get(slot, [])
    if not ids:
        known = ", ".join(f"w{s}" for s in sorted(by_slot)) or "none yet"
        raise NoSuchLog(f"no log of worker slot w{slot} in {log_dir} (slots with logs: {known})")
    chosen = f"w{slot}.{match.group(2)}" if match.group(2) else ids[-1]
    if chosen not in ids:
        raise NoSuchLog(f"no log of worker {chosen}; slot w{slot} has {', '.join(ids)}")
    if previous:
        index = ids.index(chosen)
        if index == 0:
            raise NoSuchLog(f"worker {chosen} is its slot's first attempt: there is no previous one")
        chosen = ids[index - 1]
    return os.path.join(log_dir, f"{chosen}.log")


def line_time(line: str) -> float | None:
    match = LINE_TIME.match(line)
    if not match:
        return None
    stamp = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S")
    return stamp.timestamp() + (int(match.group(2).ljust(6, "0")) / 1e6 if match.group(2) else 0.0)


def stamped(lines: list[str], start: float | None = None) -> list[tuple[float | None, str]]:
    """Each line with its time: its own leading time, else the line before's (a traceback's
    lines belong to the record that printed them)."""
    out, current = [], start
    for line in lines:
        current = line_time(line) or current
        out.append((current, line))
    return out


def format_line(when: float | None, line: str, timestamps: bool) -> str:
    if not timestamps:
        return line
    prefix = datetime.datetime.fromtimestamp(when).astimezone().isoformat(timespec="milliseconds") if when else "-"
    return f"{prefix} {line}"


def read_log(path: str, tail: int | None = None, since_s: float | None = None, timestamps: bool = False,
             now: float | None = None) -> tuple[list[str], int]:
    """The file's lines (the newest `tail`, those of the last `since_s` seconds), and the
    offset where a follower goes on."""
    with open(path, "rb") as f:
        data = f.read()
    complete = data.rfind(b"\n") + 1  # a line still being written waits for the follower
    lines = data[:complete].decode("utf-8", errors="replace").splitlines()
    rows = stamped(lines)
    if since_s is not None:
        cutoff = (time.time() if now is None else now) - since_s
        rows = [(t, line) for t, line in rows if t is not None and t >= cutoff]
    if tail is not None:
        rows = rows[-tail:] if tail > 0 else []
    return [format_line(t, line, timestamps) for t, line in rows], complete


def follow(path: str, offset: int, timestamps: bool, keep_going, poll_s: float = 0.2) -> Iterator[str]:
    """Lines appended after `offset`, while `keep_going()` says the job runs (and until the file
    has been quiet for a moment after it ended)."""
    last_time = None
    quiet_since = None
    while True:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
        complete = data.rfind(b"\n") + 1
        if complete:
            offset += complete
            quiet_since = None
            for t, line in stamped(data[:complete].decode("utf-8", errors="replace").splitlines(), last_time):
                last_time = t
                yield format_line(t, line, timestamps)
            continue
        if not keep_going():
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since > 1.0:
                return
        time.sleep(poll_s)
