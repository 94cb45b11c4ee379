"""Helpers shared by the benchmarks: prepared data, step logs, steady-state rates."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

MODEL = "elastic_step.model_zoo.digits_torch"


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def prepared_digits(root: str) -> str:
    out = os.path.join(root, "digits")
    if not os.path.exists(os.path.join(out, "manifest.json")):
        from elastic_step.data.prepare import prepare_data

        prepare_data("sklearn:digits", out, rows_per_shard=256, seed=0)
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


def elastic_step(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "elastic_step.cli", *args], **kwargs)


def torchrun(*args: str, env=None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args], env=env, **kwargs)
