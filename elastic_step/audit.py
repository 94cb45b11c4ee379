"""Checking an audit file: was every row of every epoch applied exactly once?

The file holds one JSON object per applied range, {"epoch","shard","start","count","step"}. A
resumed job first appends {"resume_from_step": S}: entries written before it with a step above
S are void (the checkpoint it resumed from predates them)."""

from __future__ import annotations

import json

import numpy as np

from elastic_step.data.manifest import load_manifest


def read_audit(path: str) -> list[dict]:
    entries: list[dict] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
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
