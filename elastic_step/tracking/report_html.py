"""A job's training report as one self-contained HTML document: loss, samples/s and world size
over time, each worker slot's attempts with their exit causes, the recoveries and the membership
events, drawn as inline SVG from what the job left in its folder (metrics.jsonl, events.jsonl,
result.json). No script and nothing fetched: the KFP UI shows an HTML artifact in a sandbox, and
clusters are often air-gapped. `render_report(job_dir)` is what a pipeline step writes out."""

from __future__ import annotations

import datetime
import html
import json
import os

from elastic_step.protocol import SHOWN_EVENTS  # the kinds shown everywhere, from one place

REPORT_NAME = "report.html"
W, H, LEFT, BOTTOM = 640, 170, 56, 22
BAR_COLORS = {"running": "#2f7d32", "died": "#b3261e", "left": "#8a6d00", "ended": "#1565c0"}


def _lines(path: str) -> list[dict]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    except OSError:
        pass
    return out


def _json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _number(v: float) -> str:
    a = abs(v)
    return f"{v:.0f}" if a >= 100 else f"{v:.2f}" if a >= 1 else f"{v:.3f}"


def line_chart(points: list[tuple[float, float]], title: str, color: str, step: bool = False) -> str:
    """An SVG line (or step) chart of (seconds, value) points."""
    parts = [f'<svg role="img" aria-label="{html.escape(title)}" viewBox="0 0 {W} {H}" width="{W}" height="{H}">',
             f'<line x1="{LEFT}" y1="{H - BOTTOM}" x2="{W}" y2="{H - BOTTOM}" stroke="#9aa3b5"/>',
             f'<line x1="{LEFT}" y1="0" x2="{LEFT}" y2="{H - BOTTOM}" stroke="#9aa3b5"/>']
    points = [(t, v) for t, v in points if v is not None and v == v]
    if not points:
        parts.append(f'<text x="{LEFT + 8}" y="20" font-size="12">no steps</text></svg>')
        return "".join(parts)
    t0, t1 = points[0][0], max(points[-1][0], points[0][0] + 1e-6)
    values = [v for _, v in points]
    lo, hi = (0.0, max(values) + 1) if step else (min(values), max(values))
    if hi - lo < 1e-12:
        hi = lo + 1

    def x(t):
        return LEFT + (W - LEFT - 6) * (t - t0) / (t1 - t0)

    def y(v):
        return 4 + (H - BOTTOM - 8) * (1 - (v - lo) / (hi - lo))

    d = []
    for i, (t, v) in enumerate(points):
        if step and i:
            d.append(f"L{x(t):.1f},{y(points[i - 1][1]):.1f}")
        d.append(f"{'L' if i else 'M'}{x(t):.1f},{y(v):.1f}")
    parts.append(f'<path class="series" d="{" ".join(d)}" fill="none" stroke="{color}" stroke-width="1.5"/>')
    parts.append(f'<text x="2" y="14" font-size="11">{_number(hi) if not step else f"{hi:.0f}"}</text>')
    parts.append(f'<text x="2" y="{H - BOTTOM}" font-size="11">{_number(lo) if not step else "0"}</text>')
    parts.append(f'<text x="{W - 4}" y="{H - 6}" font-size="11" text-anchor="end">{t1 - t0:.0f} s</text></svg>')
    return "".join(parts)


def smoothed(steps: list[dict], key: str, window: int = 10) -> list[tuple[float, float]]:
    out, t0 = [], steps[0]["time"] if steps else 0.0
    for i, s in enumerate(steps):
        recent = [p[key] for p in steps[max(0, i - window + 1):i + 1] if p.get(key) is not None]
        out.append((s["time"] - t0, sum(recent) / len(recent) if recent else None))
    return out


def attempts(events: list[dict], end: float) -> dict[int, list[dict]]:
    """Each slot's worker attempts from the events: when each began and how it ended."""
    by_worker: dict[str, dict] = {}
    for e in events:
        worker = e.get("worker")
        if e["event"] == "launched" and worker:
            by_worker[worker] = {"id": worker, "slot": e.get("slot", 0), "start": e["time"], "end": None, "how": "running", "cause": ""}
        elif e["event"] in ("died", "left") and worker in by_worker and by_worker[worker]["end"] is None:
            by_worker[worker].update(end=e["time"], how=e["event"], cause=e.get("reason", ""))
    slots: dict[int, list[dict]] = {}
    for a in by_worker.values():
        if a["end"] is None:
            a["end"], a["how"] = end, "ended"
        slots.setdefault(a["slot"], []).append(a)
    return slots


def timeline(events: list[dict], start: float, end: float) -> str:
    slots = attempts(events, end)
    row, left, width = 30, 70, 1000
    span = max(end - start, 1e-6)
    parts = [f'<svg role="img" aria-label="worker attempts" viewBox="0 0 {width} {len(slots) * row + 24}" '
             f'width="{width}" height="{len(slots) * row + 24}">']
    for i, slot in enumerate(sorted(slots)):
        top = i * row + 4
        parts.append(f'<text x="4" y="{top + 16}" font-size="12">slot {slot}</text>')
        for a in slots[slot]:
            x0 = left + (width - left - 10) * (a["start"] - start) / span
            x1 = left + (width - left - 10) * (a["end"] - start) / span
            label = a["id"] + (f" \u2014 {a['cause']}" if a["cause"] else "")
            parts.append(f'<g class="attempt" data-worker="{html.escape(a["id"])}"><title>{html.escape(label)}</title>'
                         f'<rect x="{x0:.1f}" y="{top}" width="{max(x1 - x0, 2):.1f}" height="22" rx="3" fill="{BAR_COLORS[a["how"]]}"/>'
                         f'<text x="{x0 + 4:.1f}" y="{top + 15}" font-size="12" fill="#fff">{html.escape(label)}</text></g>')
    parts.append(f'<text x="{width - 10}" y="{len(slots) * row + 18}" font-size="11" text-anchor="end">{span:.0f} s</text></svg>')
    return "".join(parts)


def describe(e: dict) -> str:
    if e["event"] == "regrouped":
        return f"round {e['round']}: {e['world_size']} workers ({', '.join(e.get('members', []))}) from step {e.get('start_step')}"
    if e["event"] == "recovered":
        return f"round {e['round']} trained again {e['seconds']:.2f} s after: {e.get('cause', '')}"
    if e["event"] == "checkpoint":
        return f"step {e['step']}"
    rest = " ".join(f"{k}={v}" for k, v in e.items() if k not in ("time", "event", "message", "members"))
    return f"{rest} {e.get('message', '')}".strip()


def render_report(job_dir: str) -> str:
    """The report of the job in `job_dir` as an HTML document (a string)."""
    steps = _lines(os.path.join(job_dir, "metrics.jsonl"))
    events = _lines(os.path.join(job_dir, "events.jsonl"))
    result = _json(os.path.join(job_dir, "result.json"))
    final = _json(os.path.join(job_dir, "status.json"))
    name = final.get("job") or os.path.basename(os.path.normpath(job_dir))
    state = result.get("state") or final.get("state") or ("succeeded" if result else "unknown")
    times = [e["time"] for e in events] + [s["time"] for s in steps]
    start = min(times) if times else 0.0
    end = final.get("ended_at") or (max(times) if times else start)
    t0 = steps[0]["time"] if steps else 0.0
    recoveries = [e for e in events if e["event"] == "recovered"]
    count = {k: sum(1 for e in events if e["event"] == k) for k in ("died", "dropped", "relaunched", "regrouped", "checkpoint")}

    figures = [("state", state), ("steps", steps[-1]["step"] if steps else result.get("steps", 0)),
               ("duration", f"{end - start:.0f} s"), ("relaunches", count["relaunched"]), ("deaths", count["died"]),
               ("dropped as hung", count["dropped"]), ("regroups", count["regrouped"]), ("checkpoints", count["checkpoint"])]
    if result.get("rows_audited"):
        figures.append(("rows audited", result["rows_audited"]))
    for k, v in (result.get("test_metrics") or {}).items():
        if k != "rows":
            figures.append((f"test {k}", f"{v:.4f}"))
    if final.get("failure"):
        figures.append(("failure", final["failure"]))
    rows = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>" for k, v in figures)
    recovery_rows = "".join(f"<tr><td>{e['round']}</td><td>{e['seconds']:.2f}</td><td>{html.escape(e.get('cause', ''))}</td></tr>"
                            for e in recoveries) or '<tr><td colspan="3">none: no worker was lost</td></tr>'
    event_rows = "".join(
        f"<tr><td>{datetime.datetime.fromtimestamp(e['time'], datetime.timezone.utc).strftime('%H:%M:%S')}</td>"
        f"<td>{html.escape(e['event'])}</td><td>{html.escape(describe(e))}</td></tr>"
        for e in events if e["event"] in SHOWN_EVENTS)
    charts = (
        "<h2>Loss</h2>" + line_chart([(s["time"] - t0, s["loss"]) for s in steps], "loss", "#1565c0")
        + "<h2>Samples/s</h2>" + line_chart(smoothed(steps, "samples_per_s"), "samples per second", "#2f7d32")
        + "<h2>World size</h2>" + line_chart([(s["time"] - t0, s["world_size"]) for s in steps], "world size", "#8a3ffc", step=True)
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(name)}: training report</title>
<style>body{{font:14px/1.4 system-ui,sans-serif;margin:20px;color:#1d2330}}table{{border-collapse:collapse}}
td,th{{text-align:left;padding:2px 12px 2px 0;font-size:13px}}h2{{font-size:15px;margin:18px 0 6px}}svg{{max-width:100%;height:auto}}</style>
</head><body>
<h1>{html.escape(name)}: {html.escape(str(state))}</h1>
<table class="summary">{rows}</table>
{charts}
<h2>Workers: each slot's attempts</h2>{timeline(events, start, end)}
<h2>Recoveries</h2><table class="recoveries"><tr><th>round</th><th>seconds</th><th>cause</th></tr>{recovery_rows}</table>
<h2>Membership events (UTC)</h2><table class="events"><tr><th>time</th><th>event</th><th>detail</th></tr>{event_rows}</table>
</body></html>
"""


def write_report(job_dir: str) -> str:
    """render_report's document in JOB_DIR/plots/report.html; returns its path."""
    path = os.path.join(job_dir, "plots", REPORT_NAME)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_report(job_dir))
    return path
