"""Checking an audit file: was every row of every epoch applied exactly once?

The file holds one JSON object per applied range, {"epoch","shard","start","count","step"}. A
resumed job first appends {"resume_from_step": S}: entries written before it with a step above
S are void (the checkpoint it resumed from predates them). A job that resumes without a
checkpoint starts over and writes {"resume_from_step": 0}: everything before it is void.

The master writes whole lines; a crash mid-write can leave the last one torn (no newline, not
JSON). Its step is later than any checkpoint (checkpoints are committed only once the audit lines
of their steps are on disk), so it is void whatever happens next: readers skip it and a resuming
master cuts it off before appending."""

from __future__ import annotations

import json
import os

import numpy as np

from elastic_step.data.manifest import load_manifest
from elastic_step.errors import ConfigError


def _torn_tail(data: bytes) -> int:
    """How many bytes at the end of `data` are a torn last line (0 when it ends whole)."""
    if not data or data.endswith(b"\n"):
        return 0
    start = data.rfind(b"\n") + 1
    try:
        json.loads(data[start:])
        return 0  # complete, only its newline is missing
    except ValueError:
        return len(data) - start


def repair_audit(path: str) -> int:
    """Cut a torn last line off an audit file, and end a whole last line that lacks its newline,
    so the next line appended starts on a line of its own. Returns the bytes cut."""
    if not os.path.exists(path):
        return 0
    with open(path, "rb+") as f:
        data = f.read()
        torn = _torn_tail(data)
        if torn:
            f.truncate(len(data) - torn)
        elif data and not data.endswith(b"\n"):
            f.write(b"\n")
        f.flush()
        os.fsync(f.fileno())
    return torn


def start_audit(path: str | None, resuming: bool) -> None:
    """Make an audit file ready for the master's ledger to append to: a new job starts an empty
    file (an old job's lines would count twice); a resuming job keeps it, repaired."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        if resuming:
            repair_audit(path)
        else:
            with open(path, "w", encoding="utf-8"):
                pass
    except OSError as exc:
        raise ConfigError(f"--audit {path}: cannot write it ({exc.strerror}); pass a writable path") from None


def read_audit(path: str) -> list[dict]:
    entries: list[dict] = []
    with open(path, "rb") as f:
        data = f.read()
    data = data[:len(data) - _torn_tail(data)]
    for number, line in enumerate(data.decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise ValueError(f"audit file {path}, line {number}, is not JSON: {line[:80]!r}") from None
        if "resume_from_step" in record:
            cut = record["resume_from_step"]
            entries = [e for e in entries if e["step"] <= cut]
        else:
            entries.append(record)
    return entries


def audit_report(audit_path: str, data: str, epochs: int, split: str = "train") -> dict:
    manifest = load_manifest(data)
    shards = {s.path: s.rows for s in manifest.splits[split]}
    counts = {(e, path): np.zeros(rows, dtype=np.int64) for e in range(epochs) for path, rows in shards.items()}
    entries = read_audit(audit_path)
    unknown = 0
    for entry in entries:
        key = (entry["epoch"], entry["shard"])
        if key not in counts:
            unknown += 1
            continue
        counts[key][entry["start"]:entry["start"] + entry["count"]] += 1
    missing = sum(int((c == 0).sum()) for c in counts.values())
    repeated = sum(int((c > 1).sum()) for c in counts.values())
    return {
        "rows_applied": int(sum(e["count"] for e in entries)),
        "rows_expected": sum(shards.values()) * epochs,
        "missing": missing,
        "repeated": repeated,
        "unknown_entries": unknown,
        "exact": missing == 0 and repeated == 0 and unknown == 0,
    }
