"""Steady-state samples/s of elastic-step against torchrun + DDP with the same number of
workers, model, data and per-worker minibatch size (target: ratio >= 0.97).

The two are run alternately, --repeats times each, and the medians compared: on a shared
machine the same command's rate moves by tens of percent from one minute to the next."""

from __future__ import annotations

import argparse
import glob
import os
import re
import statistics
import subprocess
import tempfile

from common import MODEL, elastic_step, machine, prepared_digits, read_steps, steady_rate, torchrun

MODELS = {
    "small": MODEL,  # 17k parameters: a step of a few ms, so per-step overhead shows
    "wide": os.path.join(os.path.dirname(os.path.abspath(__file__)), "wide_digits.py"),  # 8.6M: a 34 MB gradient
    "mlp512": os.path.join(os.path.dirname(os.path.abspath(__file__)), "mlp512_digits.py"),  # 64-512-512-10: 300k
}
ROUND_TIMES = re.compile(r"round \d+: (\d+) steps, [\d.]+ ms per step: (.*)$")


def step_breakdown(job_dir: str) -> dict[str, float]:
    """Milliseconds per step by phase, over every round of every worker (each worker's log
    says where its steps' time went at the end of each round)."""
    totals: dict[str, float] = {}
    steps = 0
    for path in glob.glob(os.path.join(job_dir, "logs", "w*.log")):
        for line in open(path):
            found = ROUND_TIMES.search(line.strip())
            if found:
                n = int(found.group(1))
                steps += n
                for part in found.group(2).split(", "):
                    phase, ms = part.rsplit(" ", 1)
                    totals[phase] = totals.get(phase, 0.0) + float(ms) * n
    return {phase: total / steps for phase, total in totals.items()} if steps else {}


def ours_once(data: str, workers: int, epochs: int, batch: int, job_dir: str, model: str = MODEL) -> float:
    ours = elastic_step("train", "--model-def", model, "--data", data, "--job-dir", job_dir, "--workers", str(workers),
                        "--epochs", str(epochs), "--minibatch-size", str(batch), "--minibatches-per-task", "16", "--checkpoint-steps", "0",
                        "--no-progress", stdout=subprocess.DEVNULL)
    assert ours.wait() == 0, f"elastic-step training failed; see {job_dir}/logs"
    return steady_rate(read_steps(os.path.join(job_dir, "metrics.jsonl")))


def peer_once(data: str, workers: int, epochs: int, batch: int, log: str, model: str = MODEL) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1")  # what torchrun sets for several workers per node, and our local backend too
    peer = torchrun("--standalone", "--nproc-per-node", str(workers), os.path.join(os.path.dirname(__file__), "ddp_peer.py"),
                    "--model-def", model, "--data", data, "--epochs", str(epochs), "--minibatch-size", str(batch),
                    "--step-log", log, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert peer.wait() == 0, "torchrun peer failed"
    return steady_rate(read_steps(log))


def run(workers: int, epochs: int, batch: int, repeats: int, copies: int, root: str, model: str = MODEL) -> dict:
    data = prepared_digits(root, copies)
    ours, peer, breakdowns = [], [], []
    for i in range(repeats):
        job_dir = os.path.join(root, f"elastic-{workers}-{i}")
        ours.append(ours_once(data, workers, epochs, batch, job_dir, model))
        breakdowns.append(step_breakdown(job_dir))
        peer.append(peer_once(data, workers, epochs, batch, os.path.join(root, f"ddp-{workers}-{i}.jsonl"), model))
    phases = breakdowns[0].keys() if breakdowns and breakdowns[0] else []
    return {"workers": workers, "ours": ours, "peer": peer,
            "ratio": statistics.median(ours) / statistics.median(peer),
            "breakdown": {p: statistics.median(b.get(p, 0.0) for b in breakdowns) for p in phases}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, nargs="+", default=[2])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--minibatch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, alternating; medians are compared")
    parser.add_argument("--copies", type=int, default=40, help="digits rows repeated (with noise) this many times")
    parser.add_argument("--model", choices=sorted(MODELS), default="small",
                        help="small: a step of a few ms; mlp512: 64-512-512-10, 300k parameters (the goodput "
                             "benchmark's); wide: a 34 MB gradient (use fewer --copies)")
    args = parser.parse_args()
    print(f"throughput: {args.model} digits MLP (x{args.copies} rows), minibatch {args.minibatch_size} per worker, {args.epochs} epochs, "
          f"{args.repeats} alternating runs each; {machine()}")
    with tempfile.TemporaryDirectory() as root:
        for n in args.workers:
            r = run(n, args.epochs, args.minibatch_size, args.repeats, args.copies, root, MODELS[args.model])
            runs = lambda rates: ", ".join(f"{x:.0f}" for x in rates)  # noqa: E731
            print(f"  N={n}: elastic-step {statistics.median(r['ours']):8.0f} samples/s (runs {runs(r['ours'])})   "
                  f"torchrun+DDP {statistics.median(r['peer']):8.0f} samples/s (runs {runs(r['peer'])})   "
                  f"ratio {r['ratio']:.3f} (target >= 0.97)")
            if r["breakdown"]:
                parts = ", ".join(f"{phase} {ms:.2f}" for phase, ms in r["breakdown"].items())
                print(f"        elastic-step per step, median of runs (ms): {parts}; total {sum(r['breakdown'].values()):.2f}")


if __name__ == "__main__":
    main()
