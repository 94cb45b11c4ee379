"""Results that do not depend on failures: the same job with a fixed global batch
(`--global-batch-size`), run clean with several seeds and run with workers SIGKILLed at random
points (the backend relaunches them, so the group shrinks and grows during the run).

Prints, per run: the optimizer steps applied, the rows per step, the world sizes seen, the test
loss and accuracy. The disturbed runs must take exactly the clean run's steps, and end with a
test loss within the spread of the clean runs over seeds.

    ../.venv/bin/python bench_equivalence.py --seeds 0 1 2 --disturbed 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from common import MODEL, elastic_step, job_status, machine, prepared_digits, read_steps, wait_until


def train(data: str, job_dir: str, args, seed: int, kills: int, rng: random.Random) -> dict:
    job = elastic_step("train", "--model-def", MODEL, "--data", data, "--job-dir", job_dir, "--workers", f"1:{args.workers}",
                       "--epochs", str(args.epochs), "--minibatch-size", str(args.minibatch_size),
                       "--global-batch-size", str(args.global_batch_size), "--seed", str(seed), "--checkpoint-steps", "0",
                       "--max-relaunches", str(kills + 1), "--no-progress",
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    killed = 0
    try:
        # Kill points spread over the run: at random fractions of the rows, one kill each.
        for fraction in sorted(rng.uniform(0.1, 0.85) for _ in range(kills)):
            s = wait_until(lambda: (st := job_status(job_dir)) and st.get("rows_total")
                           and st["rows_done"] / st["rows_total"] >= fraction and st, 300, f"{fraction:.0%} of the rows")
            live = [w for w in s["workers"] if w["state"] == "live" and w.get("pid")]
            if len(live) > 1:
                os.kill(rng.choice(live)["pid"], signal.SIGKILL)
                killed += 1
        if job.wait(900) != 0:
            sys.exit(f"training failed; see {job_dir}/logs")
    finally:
        if job.poll() is None:
            job.send_signal(signal.SIGTERM)
            job.wait(30)
    steps = read_steps(os.path.join(job_dir, "metrics.jsonl"))
    with open(os.path.join(job_dir, "result.json")) as f:
        result = json.load(f)
    return {"seed": seed, "killed": killed, "steps": len(steps), "samples": [s["samples"] for s in steps],
            "worlds": sorted({s["world_size"] for s in steps}), "loss": result["test_metrics"]["loss"],
            "accuracy": result["test_metrics"]["accuracy"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--minibatch-size", type=int, default=32)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="clean runs, one per seed")
    parser.add_argument("--disturbed", type=int, default=3, help="runs of the first seed with workers killed")
    parser.add_argument("--kills", type=int, default=3, help="SIGKILLs per disturbed run")
    args = parser.parse_args()
    # Plain digits: its test split holds rows no epoch trained on (the tiled sets' does not).
    print(f"equivalence: digits MLP, --workers 1:{args.workers}, --global-batch-size "
          f"{args.global_batch_size}, --minibatch-size {args.minibatch_size}, {args.epochs} epochs; {machine()}")
    rng = random.Random(1)
    runs = []
    with tempfile.TemporaryDirectory() as root:
        data = prepared_digits(root)
        for seed in args.seeds:
            runs.append(("clean", train(data, os.path.join(root, f"clean-{seed}"), args, seed, 0, rng)))
        for i in range(args.disturbed):
            runs.append(("disturbed", train(data, os.path.join(root, f"disturbed-{i}"), args, args.seeds[0], args.kills, rng)))
    print(f"{'run':10} {'seed':>4} {'kills':>5} {'steps':>6} {'rows/step (all but last)':>25} {'worlds':>10} "
          f"{'test loss':>10} {'accuracy':>9}")
    for kind, r in runs:
        sizes = sorted(set(r["samples"][:-1]))
        print(f"{kind:10} {r['seed']:>4} {r['killed']:>5} {r['steps']:>6} {str(sizes):>25} {str(r['worlds']):>10} "
              f"{r['loss']:>10.4f} {r['accuracy']:>9.4f}")
    clean = [r for kind, r in runs if kind == "clean"]
    disturbed = [r for kind, r in runs if kind == "disturbed"]
    losses = [r["loss"] for r in clean]
    low, high = min(losses), max(losses)
    print(f"clean runs over {len(clean)} seeds: test loss {low:.4f} .. {high:.4f} (spread {high - low:.4f}, "
          f"median {statistics.median(losses):.4f})")
    rows = sum(clean[0]["samples"])
    fixed = [args.global_batch_size] * (rows // args.global_batch_size) + ([rows % args.global_batch_size] if rows % args.global_batch_size else [])
    print(f"every run took {len(fixed)} steps of {args.global_batch_size} rows, the last {fixed[-1]}: "
          f"{'yes' if all(r['samples'] == fixed for _, r in runs) else 'NO'}")
    same_steps = all(r["samples"] == clean[0]["samples"] for r in disturbed)
    inside = [low - 1e-9 <= r["loss"] <= high + 1e-9 for r in disturbed]
    print(f"disturbed runs: the clean run's steps, row for row: {'yes' if same_steps else 'NO'}; "
          f"test loss within the clean spread: {sum(inside)} of {len(disturbed)} "
          f"({', '.join(format(r['loss'], '.4f') for r in disturbed)})")


if __name__ == "__main__":
    main()
