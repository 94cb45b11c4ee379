"""Helpers shared by the benchmarks: prepared data, step logs, steady-state rates."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time

MODEL = "elastic_step.model_zoo.digits_torch"


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def prepared_digits(root: str, copies: int = 1) -> str:
    """The digits data prepared for training. With copies > 1, each of its 1,797 rows appears
    `copies` times with a little pixel noise, in 4,096-row shards: epochs of hundreds of steps,
    so that steady-state figures are not made of epoch boundaries."""
    out = os.path.join(root, "digits" if copies == 1 else f"digits-x{copies}")
    if os.path.exists(os.path.join(out, "manifest.json")):
        return out
    from elastic_step.data.prepare import prepare_data

    if copies == 1:
        prepare_data("sklearn:digits", out, rows_per_shard=256, seed=0)
        return out
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(0)
    pixels = np.tile(digits.data, (copies, 1)) + rng.normal(0.0, 0.5, (copies * len(digits.data), digits.data.shape[1]))
    columns = {f"pixel_{i}": pa.array(np.clip(pixels[:, i], 0, 16).astype(np.float32)) for i in range(pixels.shape[1])}
    columns["label"] = pa.array(np.tile(digits.target, copies).astype(np.int64))
    source = os.path.join(root, f"digits-x{copies}.parquet")
    pq.write_table(pa.table(columns), source)
    prepare_data(source, out, rows_per_shard=4096, row_group_rows=1024, seed=0)
    return out


def read_steps(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def steady_rate(steps: list[dict], skip: float = 0.2) -> float:
    """Samples per second over the steps after the first `skip` fraction (warm-up) and before
    the last 5% (shutdown)."""
    steps = sorted(steps, key=lambda s: s["time"])
    first, last = int(len(steps) * skip), max(int(len(steps) * 0.95), int(len(steps) * skip) + 2)
    window = steps[first:last]
    span = window[-1]["time"] - window[0]["time"]
    return sum(s["samples"] for s in window[1:]) / span


def live_pids_with_env(marker: bytes) -> list[int]:
    """Live (not zombie) processes whose environment holds `marker` (NAME=VALUE): a job's
    workers, say, by the token file every one of them is started with."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[-1].split()[0] != "Z":
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def elastic_step(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "elastic_step.cli", *args], **kwargs)


def job_status(job_dir: str) -> dict | None:
    """`status --json` of a running job as one dict: its summary's fields beside its `workers`
    (the command prints {"summary": {...}, "workers": [...]}); None while it cannot answer."""
    done = subprocess.run([sys.executable, "-m", "elastic_step.cli", "status", "--job-dir", job_dir, "--json"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        return None
    view = json.loads(done.stdout)
    return {**view["summary"], "workers": view["workers"]}


def training_worker_pids(job_dir: str) -> list[int]:
    """The pids of the workers training in a job's current round, as its status says: a
    replacement still starting up is no worker to disturb (nor are a proposed round's members)."""
    from elastic_step.operate.client import try_status

    status = try_status(job_dir)
    if not status or not status["round_ready"]:
        return []
    return [w["pid"] for w in status["workers"] if w["rank"] is not None and w["state"] == "live" and w.get("pid")]


def torchrun(*args: str, env=None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args], env=env, **kwargs)


def wait_until(predicate, timeout: float, what: str):
    """The predicate's first true value, polled every 50 ms; TimeoutError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(what)
