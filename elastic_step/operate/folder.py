"""A job as `get`, `top` and `list` show it: found by its folder (or its name under a root),
read from its live master, or, once the master is gone, from what the job left in its folder
(status.json, result.json, events.jsonl). Pure data: the CLI renders it."""

from __future__ import annotations

import json
import os
import time

from elastic_step.errors import ElasticStepError, MasterUnreachable
from elastic_step.operate.client import JobClient, WrongToken, check_own_folder, read_token_file
from elastic_step.operate.documents import checked_events, checked_status
from elastic_step.protocol import SHOWN_EVENTS, EventKind

# What a job folder holds once `train` has started in it.
JOB_MARKERS = ("master.json", "result.json", "status.json", "events.jsonl")
# The events `get -e` shows: those people are shown everywhere, and a slot's relaunched attempts.
MEMBERSHIP_EVENTS = (EventKind.LAUNCHED, *SHOWN_EVENTS)


class UnknownJob(ElasticStepError):
    """No job folder by that name."""


def find_job(ref: str, root: str | None = None) -> str:
    """The folder of job `ref`: a job folder itself, or a job's name under `root`."""
    candidates = [ref] + ([os.path.join(root, ref)] if root else [])
    for path in candidates:
        if os.path.isdir(path) and any(os.path.exists(os.path.join(path, m)) for m in JOB_MARKERS):
            return os.path.abspath(path)
    where = f" or under {root}" if root else ""
    raise UnknownJob(f"no job {ref!r} (no job folder at {ref}{where}); pass the job's --job-dir folder, "
                     "or see the jobs with `elastic-step list --root DIR`")


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read_events(job_dir: str) -> list[dict]:
    events = []
    try:
        with open(os.path.join(job_dir, "events.jsonl")) as f:
            for line in f:
                try:
                    events.append(json.loads(line))
                except ValueError:
                    continue  # a line torn by a killed master
    except OSError:
        pass
    return checked_events(events)


def load_job(job_dir: str, with_events: bool = True, timeout_s: float = 5.0) -> dict:
    """{"live": bool, "status", "events", "info", "result"} of the job in `job_dir`. A master
    that is gone is no error when the job ended (its final status is in the folder)."""
    info = _read_json(os.path.join(job_dir, "master.json")) or {}
    result = _read_json(os.path.join(job_dir, "result.json"))
    final = _final_status(job_dir)
    if info and not (final or result):
        check_own_folder(job_dir)  # said as it is, rather than as a master that does not answer
        try:
            client = JobClient(job_dir, timeout_s=timeout_s)
        except MasterUnreachable:
            client = None
        if client is not None:
            try:
                status = client.status()
                events = client.events()["events"] if with_events else []
                return {"live": True, "status": status, "events": events, "info": info, "result": None}
            except WrongToken:
                raise
            except MasterUnreachable as exc:
                final = _final_status(job_dir)  # it may have ended just now
                if final is None:
                    raise MasterUnreachable(
                        f"{exc}. It left no final status, so it did not end on its own (killed?): "
                        "`elastic-step train ... --resume` continues it from its newest checkpoint") from None
            finally:
                client.close()
    if final is None and result is None:
        if not info:
            raise UnknownJob(f"{job_dir} has no job that started (no master.json); start one with `elastic-step train --job-dir`")
        raise MasterUnreachable(f"the job in {job_dir} has no master answering and no final status; "
                                "`elastic-step train ... --resume` continues it from its newest checkpoint")
    status = final or {"job": info.get("job", os.path.basename(job_dir)), "workers": []}
    if result is not None:
        status["state"] = result.get("state", "succeeded")
    return {"live": False, "status": status, "events": read_events(job_dir) if with_events else [], "info": info,
            "result": result}


def _final_status(job_dir: str) -> dict | None:
    """The status a master left as it ended (status.json), checked; None when there is none."""
    path = os.path.join(job_dir, "status.json")
    final = _read_json(path)
    return checked_status(final, path) if final is not None else None


def _age(then: float | None, now: float) -> float | None:
    return round(max(now - then, 0.0), 1) if then else None


def worker_rows(status: dict, now: float) -> list[dict]:
    """One row per slot's newest attempt, with that slot's earlier attempts as its relaunches."""
    by_slot: dict[int, list[dict]] = {}
    for w in status.get("workers", []):
        by_slot.setdefault(w["slot"], []).append(w)
    rows = []
    for slot in sorted(by_slot):
        attempts = sorted(by_slot[slot], key=lambda w: int(w["id"].rsplit(".", 1)[1]) if "." in w["id"] else 0)
        w, earlier = attempts[-1], attempts[:-1]
        resources = w.get("resources") or {}
        gpus = resources.get("gpus") or []
        rows.append({
            "id": w["id"], "slot": slot, "rank": w.get("rank"), "spare": bool(w.get("spare")), "state": w["state"],
            "pid": w.get("pid"), "pod": w.get("pod"), "node": w.get("node") or w.get("host") or "",
            "cpu_percent": resources.get("cpu_percent"), "rss_bytes": resources.get("rss_bytes"),
            "gpus": [{"index": g["index"], "utilization_percent": g["utilization_percent"],
                      "memory_used_bytes": g["memory_used_bytes"], "memory_total_bytes": g["memory_total_bytes"]} for g in gpus],
            "steps": w.get("step", -1), "rows_applied": w.get("rows_applied", 0),
            "heartbeat_age_s": _age(w.get("last_seen"), now) if w["state"] != "gone" else None,
            "relaunches": len(earlier), "relaunch_causes": [e.get("exit") or "?" for e in earlier],
            "exit": w.get("exit", ""),
        })
    return rows


def ps_shard_rows(status: dict, live: bool) -> list[dict]:
    """One row per parameter-server shard, as the master last polled it; an ended job's shards
    are stopped with it (their last numbers stand; they update nothing more)."""
    keys = ("shard", "address", "state", "rows", "bytes", "pushes", "updates_per_s", "relaunches")
    rows = [{k: s.get(k) for k in keys} for s in status.get("ps_shards", [])]
    for r in rows:
        if not live:
            r["updates_per_s"] = None
        if not live and r["state"] != "down":
            r["state"] = "ended"
    return rows


def tensorboard_command(job: dict, job_dir: str) -> str:
    """How to look at the job's TensorBoard scalars: its folder's, or, for a master in a pod
    (whose folder nobody outside it reads), the copy in its MLflow run."""
    if not job.get("remote"):
        return f"tensorboard --logdir {os.path.join(job_dir, 'tensorboard')}"
    run_id = (job["info"].get("mlflow") or {}).get("run_id")
    if not run_id:
        return "in the job's MLflow run (artifacts/tensorboard) once it has one"
    return f"mlflow artifacts download -r {run_id} -a tensorboard -d tb && tensorboard --logdir tb"


def summary(job: dict, job_dir: str, now: float | None = None) -> dict:
    now = time.time() if now is None else now
    status, info, result = job["status"], job["info"], job["result"] or {}
    events = job["events"]
    started = status.get("started_at") or info.get("started_at")
    ended = status.get("ended_at")
    checkpoints = [e["step"] for e in events if e["event"] == "checkpoint"]
    mlflow = dict(info.get("mlflow") or {})
    if result.get("run_id"):
        mlflow.setdefault("run_id", result["run_id"])
    epochs = status.get("epochs")
    out = {
        "job": status.get("job") or info.get("job") or os.path.basename(job_dir),
        "job_dir": job_dir,
        "live": job["live"],
        "state": status.get("state", "unknown") + (" (stopping)" if status.get("stopping") else ""),
        "failure": status.get("failure", ""),
        "backend": info.get("backend", ""),
        "duration_s": round((ended or now) - started, 1) if started else result.get("seconds"),
        "round": status.get("round"),
        "world_size": status.get("world_size"),
        "target_workers": status.get("target_workers"),
        "workers_range": status.get("workers_range"),
        "spares": status.get("spares") or 0,
        "epoch": status["epoch"] + 1 if status.get("epoch") is not None else None,
        "epochs": epochs,
        "rows_done": status.get("rows_done"),
        "rows_total": status.get("rows_total"),
        "step": status.get("step", result.get("steps")),
        "loss": status.get("loss"),
        "samples_per_s": status.get("samples_per_s"),
        "checkpoints": checkpoints,
        "recoveries_s": [e["seconds"] for e in events if e["event"] == "recovered"],
        "mlflow": mlflow,
        "tensorboard": tensorboard_command(job, job_dir),
    }
    if info.get("url") and job["live"]:
        out["ui"] = live_page_url(info, job_dir)
    if result.get("test_metrics"):
        out["test_metrics"] = result["test_metrics"]
    return out


def live_page_url(info: dict, job_dir: str) -> str:
    """The live page's address with the read-only token in its fragment (a browser never sends
    the fragment to the server, so the token stays out of every access log); without a readable
    view token, the address alone (the page then says what it needs)."""
    from elastic_step.protocol import UI_PAGE

    try:
        return f"{info['url']}{UI_PAGE}#token={read_token_file(os.path.join(job_dir, 'view-token'))}"
    except OSError:
        return f"{info['url']}{UI_PAGE}"


def membership_events(events: list[dict]) -> list[dict]:
    return [e for e in events if e["event"] in MEMBERSHIP_EVENTS and not (e["event"] == "launched" and e.get("attempt") == 1)]


def job_view(job_dir: str, with_events: bool = False, now: float | None = None) -> dict:
    return view_of(load_job(job_dir, with_events=True), job_dir, with_events, now)


def view_of(job: dict, where: str, with_events: bool = False, now: float | None = None) -> dict:
    """What `get` and `top` show of a loaded job; `where`: its folder, or its master's pod."""
    now = time.time() if now is None else now
    rows = worker_rows(job["status"], now)
    if not job["live"]:
        for r in rows:  # as the master last saw them; it is gone, and so are they
            r["heartbeat_age_s"] = None
            if r["state"] != "gone":
                r["state"] = "ended"
    view = {"summary": summary(job, where, now), "workers": rows}
    if job["status"].get("ps_shards"):  # a --mode ps job's parameter-server shards
        view["ps_shards"] = ps_shard_rows(job["status"], job["live"])
    if with_events:
        view["events"] = membership_events(job["events"])
    return view


def list_local(root: str) -> list[dict]:
    """One row per job folder directly under `root` (live ones asked, ended ones read)."""
    rows = []
    try:
        names = sorted(os.listdir(root))
    except OSError as exc:
        raise UnknownJob(f"cannot list jobs under {root}: {exc.strerror}; pass --root DIR, the folder holding job folders") from None
    now = time.time()
    for name in names:
        path = os.path.join(root, name)
        if not (os.path.isdir(path) and any(os.path.exists(os.path.join(path, m)) for m in JOB_MARKERS)):
            continue
        try:
            job = load_job(path, with_events=False, timeout_s=2.0)
        except ElasticStepError as exc:
            rows.append({"job": name, "job_dir": path, "state": "unreachable", "note": str(exc).split(";")[0]})
            continue
        s = summary(job, path, now)
        live = sum(1 for w in job["status"].get("workers", []) if w["state"] == "live")
        rows.append({**{k: s[k] for k in ("job", "job_dir", "state", "duration_s", "epoch", "epochs", "rows_done", "rows_total",
                                          "samples_per_s", "target_workers")}, "workers_live": live})
    return rows
