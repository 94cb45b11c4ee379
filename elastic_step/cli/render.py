"""How `get`, `list` and `top` show a job: rich tables, plain where the output is no terminal."""

from __future__ import annotations

import datetime

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from elastic_step.terminal import printable


def size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"


def seconds(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def gpus(row: dict) -> str:
    return ", ".join(f"{g['index']}: {g['utilization_percent']:.0f}% {size(g['memory_used_bytes'])}/{size(g['memory_total_bytes'])}"
                     for g in row["gpus"]) or "-"


def summary_lines(s: dict) -> list[str]:
    state = s["state"] + (f" ({s['failure']})" if s.get("failure") else "")
    lines = [f"job {s['job']}: {state}   {s['job_dir']}"]
    progress = ""
    if s.get("rows_total"):
        progress = f"rows {s['rows_done']}/{s['rows_total']} ({100 * s['rows_done'] / s['rows_total']:.0f}%)"
    loss = f"loss {s['loss']:.4f}" if s.get("loss") is not None else "loss -"
    if s.get("epochs"):
        lines.append(f"duration {seconds(s['duration_s'])}  round {s['round']}  workers {s['world_size']}/{s['target_workers']} "
                     f"(range {':'.join(map(str, s['workers_range'] or []))})" + (f"  spares {s['spares']}" if s.get("spares") else "")
                     + f"  epoch {s['epoch']}/{s['epochs']}  {progress}")
        lines.append(f"step {s['step']}  {loss}  {s['samples_per_s'] or 0:.0f} samples/s")
    else:
        lines.append(f"duration {seconds(s['duration_s'])}  step {s.get('step')}")
    cps = s["checkpoints"]
    lines.append(f"checkpoints: {len(cps)}" + (f" (newest step {cps[-1]})" if cps else ""))
    if s["recoveries_s"]:
        lines.append("recoveries: " + ", ".join(f"{r:.2f}s" for r in s["recoveries_s"]))
    mlflow = s.get("mlflow") or {}
    if mlflow.get("run_id"):
        uri = mlflow.get("tracking_uri", "")
        where = f"  {mlflow['ui']}" if mlflow.get("ui") else f"  (browse: mlflow ui --backend-store-uri {uri})" if uri.startswith("sqlite:") else ""
        lines.append(f"mlflow: run {mlflow['run_id']} at {uri}{where}")
    if s.get("test_metrics"):
        lines.append("test: " + "  ".join(f"{k} {v:.4f}" for k, v in s["test_metrics"].items() if k != "rows"))
    if s.get("ui"):
        lines.append(f"live page (read-only token): {s['ui']}")
    lines.append(f"tensorboard: {s['tensorboard']}")
    return lines


def row(table: Table, *cells: str) -> None:
    """Cells as plain text: a worker's exit cause or a path may hold brackets rich would read as
    markup, or control characters a terminal would act on."""
    table.add_row(*(Text(printable(str(c))) for c in cells))


def worker_table(rows: list[dict]) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("WORKER", "RANK", "STATE", "PID/POD", "NODE", "CPU", "RSS", "GPU", "STEPS", "HEARTBEAT", "RELAUNCHES"):
        table.add_column(column, no_wrap=column not in ("RELAUNCHES", "GPU"))
    for r in rows:
        relaunches = str(r["relaunches"]) + (f" ({'; '.join(r['relaunch_causes'])})" if r["relaunch_causes"] else "")
        state = r["state"] + (f": {r['exit']}" if r["state"] == "gone" and r["exit"] else "")
        row(
            table, r["id"], ("spare" if r.get("spare") else "-") if r["rank"] is None else str(r["rank"]), state, r["pod"] or (str(r["pid"]) if r["pid"] else "-"),
            r["node"] or "-", "-" if r["cpu_percent"] is None else f"{r['cpu_percent']:.0f}%", size(r["rss_bytes"]), gpus(r),
            str(r["steps"]), "-" if r["heartbeat_age_s"] is None else f"{r['heartbeat_age_s']:.1f}s ago", relaunches,
        )
    return table


def ps_shard_table(rows: list[dict]) -> Table:
    """A --mode ps job's parameter-server shards: where each listens, what it holds and did."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("PS SHARD", "ADDRESS", "STATE", "ROWS", "MEMORY", "PUSHES", "UPDATES/S", "RELAUNCHES"):
        table.add_column(column, no_wrap=True)
    for r in rows:
        rate = "-" if r.get("updates_per_s") is None else f"{r['updates_per_s']:.1f}"
        row(table, str(r["shard"]), r["address"], r["state"], str(r["rows"]), size(r["bytes"]), str(r["pushes"]), rate,
            str(r["relaunches"]))
    return table


def describe_event(e: dict) -> str:
    kind = e["event"]
    extra = {k: v for k, v in e.items() if k not in ("time", "event", "message", "members")}
    if kind == "regrouped":
        text = f"round {e['round']}: {e['world_size']} workers {', '.join(e.get('members', []))}, from step {e.get('start_step')}"
    elif kind == "recovered":
        # An ended job's events read back from MLflow's metric history carry no round or cause.
        within = f"round {e['round']} " if "round" in e else ""
        text = f"{within}trained again {e['seconds']:.2f}s after: {e.get('cause', '')}".rstrip(": ")
    elif kind == "checkpoint":
        text = f"step {e['step']} (epoch {e.get('epoch', 0) + 1})"
    else:
        text = " ".join(f"{k}={v}" for k, v in extra.items())
    if e.get("message"):
        text = f"{text} {e['message']}".strip()
    return text if len(text) <= 160 else text[:157] + "..."


def event_table(events: list[dict]) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("TIME", "EVENT", "DETAIL"):
        table.add_column(column)
    for e in events:
        when = datetime.datetime.fromtimestamp(e["time"]).strftime("%H:%M:%S.%f")[:-3]
        name = "dropped (hung)" if e["event"] == "dropped" and "hung" in e.get("message", "") else e["event"]
        row(table, when, name, describe_event(e))
    return table


def job_tables(view: dict) -> Group:
    parts = [Text(printable("\n".join(summary_lines(view["summary"])))), Text(""), worker_table(view["workers"])]
    if view.get("ps_shards"):
        parts += [Text(""), ps_shard_table(view["ps_shards"])]
    if "events" in view:
        parts += [Text(""), Text("events", style="bold"), event_table(view["events"])]
    return Group(*parts)


def print_job(view: dict) -> None:
    Console(width=200, soft_wrap=False).print(job_tables(view))


def job_list_table(rows: list[dict]) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("JOB", "STATE", "AGE", "WORKERS", "EPOCH", "PROGRESS", "SAMPLES/S", "WHERE"):
        table.add_column(column, no_wrap=True)
    for r in rows:
        progress = f"{100 * r['rows_done'] / r['rows_total']:.0f}%" if r.get("rows_total") else "-"
        epoch = f"{r['epoch']}/{r['epochs']}" if r.get("epochs") else "-"
        workers = f"{r.get('workers_live', 0)}/{r.get('target_workers') or '-'}"
        sps = f"{r['samples_per_s']:.0f}" if r.get("samples_per_s") is not None else "-"
        row(table, r["job"], r["state"], seconds(r.get("duration_s")), workers, epoch, progress, sps,
                      r.get("where", ""))
    return table


def print_job_list(rows: list[dict]) -> None:
    if not rows:
        print("no jobs")
        return
    Console(width=200, soft_wrap=False).print(job_list_table(rows))
