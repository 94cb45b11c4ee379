"""Checkpoint cost and resume speed.

1. Training stall from checkpointing every 100 steps: mean step time with checkpoints / without,
   same run length (target <= 1.05).
2. Time to resume after a master restart: from the new `train --resume` process start to its
   first applied step."""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from common import MODEL, elastic_step, machine, prepared_digits, read_steps


def step_time(job_dir: str) -> float:
    steps = sorted(read_steps(os.path.join(job_dir, "metrics.jsonl")), key=lambda s: s["step"])
    steps = steps[len(steps) // 5:]  # past the warm-up
    return (steps[-1]["time"] - steps[0]["time"]) / (len(steps) - 1)


def train(root: str, name: str, data: str, *extra: str) -> str:
    job_dir = os.path.join(root, name)
    job = elastic_step("train", "--model-def", MODEL, "--data", data, "--job-dir", job_dir, "--workers", "2",
                       "--epochs", "30", "--minibatch-size", "16", "--no-progress", *extra,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert job.wait() == 0, f"{name} failed"
    return job_dir


def resume_time(root: str, data: str) -> float:
    job_dir = os.path.join(root, "resume")
    args = ["train", "--model-def", MODEL, "--data", data, "--job-dir", job_dir, "--workers", "2", "--epochs", "200",
            "--minibatch-size", "16", "--no-progress", "--checkpoint-steps", "100", "--master-timeout", "3"]
    first = elastic_step(*args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    events = os.path.join(job_dir, "events.jsonl")
    while not (os.path.exists(events) and sum('"checkpoint"' in line for line in open(events)) >= 2):
        time.sleep(0.2)
    first.send_signal(signal.SIGKILL)
    first.wait()
    time.sleep(4)  # its workers leave on their own
    started = time.time()
    second = elastic_step(*args, "--resume", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if os.path.exists(events):
                recovered = [json.loads(l) for l in open(events) if '"recovered"' in l or '"regrouped"' in l]
                # the first applied step of the resumed job is the first metrics entry after `started`
                steps = [s for s in read_steps(os.path.join(job_dir, "metrics.jsonl")) if s["time"] > started]
                if recovered and steps:
                    return steps[0]["time"] - started
            time.sleep(0.1)
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(f"checkpoints: digits MLP, 2 workers, minibatch 16, SQLite tracking; {machine()}")
    with tempfile.TemporaryDirectory() as root:
        data = prepared_digits(root)
        off, on = [], []
        for i in range(args.repeats):
            off.append(step_time(train(root, f"off-{i}", data, "--checkpoint-steps", "0")))
            on.append(step_time(train(root, f"on-{i}", data, "--checkpoint-steps", "100")))
        a, b = statistics.median(on), statistics.median(off)
        print(f"  step time with a checkpoint every 100 steps {a * 1e3:.3f} ms, without {b * 1e3:.3f} ms: "
              f"ratio {a / b:.3f} (target <= 1.05)")
        print(f"  resume after a master SIGKILL: {resume_time(root, data):.2f}s from process start to the first applied step")


if __name__ == "__main__":
    main()
