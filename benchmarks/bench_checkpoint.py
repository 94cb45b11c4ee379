"""Checkpoint cost and resume speed.

1. Training stall from checkpointing every 100 steps: mean step time with checkpoints / without,
   same run length (target <= 1.05).
2. Time to resume after a master restart: from the new `train --resume` process start to its
   first applied step."""

from __future__ import annotations

import argparse
import json
import os
import resource
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


def checkpoints_committed(job_dir: str) -> int:
    with open(os.path.join(job_dir, "events.jsonl")) as f:
        return sum(json.loads(line)["event"] == "checkpoint" for line in f if line.strip())


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def train(root: str, name: str, data: str, args, *extra: str) -> tuple[str, float]:
    """Runs one job; returns its folder and the CPU seconds it used (master and workers)."""
    job_dir = os.path.join(root, name)
    cpu_before = children_cpu_s()
    job = elastic_step("train", "--model-def", MODEL, "--data", data, "--job-dir", job_dir, "--workers", "2",
                       "--epochs", str(args.epochs), "--minibatch-size", str(args.minibatch_size), "--no-progress", *extra,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert job.wait() == 0, f"{name} failed"
    return job_dir, children_cpu_s() - cpu_before


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
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, alternating; medians compared")
    parser.add_argument("--copies", type=int, default=40, help="noisy copies of digits (long epochs)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--minibatch-size", type=int, default=16)
    args = parser.parse_args()
    print(f"checkpoints: digits MLP, digits x{args.copies}, {args.epochs} epochs, 2 workers, minibatch {args.minibatch_size}, "
          f"SQLite tracking; {machine()}")
    with tempfile.TemporaryDirectory() as root:
        data = prepared_digits(root, args.copies)
        off, on, cpu_per_checkpoint = [], [], []
        for i in range(args.repeats):
            job_dir, cpu_off = train(root, f"off-{i}", data, args, "--checkpoint-steps", "0")
            off.append(step_time(job_dir))
            job_dir, cpu_on = train(root, f"on-{i}", data, args, "--checkpoint-steps", "100")
            on.append(step_time(job_dir))
            committed = checkpoints_committed(job_dir)
            cpu_per_checkpoint.append((cpu_on - cpu_off) / committed)
            print(f"  run {i + 1}: {on[-1] * 1e3:.3f} ms per step with checkpoints ({committed} committed, "
                  f"{cpu_on:.1f} CPU-s), {off[-1] * 1e3:.3f} ms without ({cpu_off:.1f} CPU-s)", flush=True)
        a, b = statistics.median(on), statistics.median(off)
        print(f"  step time with a checkpoint every 100 steps {a * 1e3:.3f} ms, without {b * 1e3:.3f} ms: "
              f"ratio {a / b:.3f} (target <= 1.05); extra CPU per checkpoint, all processes: "
              f"{statistics.median(cpu_per_checkpoint) * 1e3:.0f} ms (median)")
        print(f"  resume after a master SIGKILL: {resume_time(root, data):.2f}s from process start to the first applied step")


if __name__ == "__main__":
    main()
