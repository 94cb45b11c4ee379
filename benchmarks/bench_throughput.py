"""Steady-state samples/s of elastic-step against torchrun + DDP with the same number of
workers, model, data and per-worker minibatch size (target: ratio >= 0.97).

The two are run alternately, --repeats times each, and the medians compared: on a shared
machine the same command's rate moves by tens of percent from one minute to the next."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile

from common import MODEL, elastic_step, machine, prepared_digits, read_steps, steady_rate, torchrun


def ours_once(data: str, workers: int, epochs: int, batch: int, job_dir: str) -> float:
    ours = elastic_step("train", "--model-def", MODEL, "--data", data, "--job-dir", job_dir, "--workers", str(workers),
                        "--epochs", str(epochs), "--minibatch-size", str(batch), "--minibatches-per-task", "16", "--checkpoint-steps", "0",
                        "--no-progress", stdout=subprocess.DEVNULL)
    assert ours.wait() == 0, f"elastic-step training failed; see {job_dir}/logs"
    return steady_rate(read_steps(os.path.join(job_dir, "metrics.jsonl")))


def peer_once(data: str, workers: int, epochs: int, batch: int, log: str) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1")  # what torchrun sets for several workers per node, and our local backend too
    peer = torchrun("--standalone", "--nproc-per-node", str(workers), os.path.join(os.path.dirname(__file__), "ddp_peer.py"),
                    "--model-def", MODEL, "--data", data, "--epochs", str(epochs), "--minibatch-size", str(batch),
                    "--step-log", log, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert peer.wait() == 0, "torchrun peer failed"
    return steady_rate(read_steps(log))


def run(workers: int, epochs: int, batch: int, repeats: int, copies: int, root: str) -> dict:
    data = prepared_digits(root, copies)
    ours, peer = [], []
    for i in range(repeats):
        ours.append(ours_once(data, workers, epochs, batch, os.path.join(root, f"elastic-{workers}-{i}")))
        peer.append(peer_once(data, workers, epochs, batch, os.path.join(root, f"ddp-{workers}-{i}.jsonl")))
    return {"workers": workers, "ours": ours, "peer": peer,
            "ratio": statistics.median(ours) / statistics.median(peer)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, nargs="+", default=[2])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--minibatch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, alternating; medians are compared")
    parser.add_argument("--copies", type=int, default=40, help="digits rows repeated (with noise) this many times")
    args = parser.parse_args()
    print(f"throughput: digits MLP (x{args.copies} rows), minibatch {args.minibatch_size} per worker, {args.epochs} epochs, "
          f"{args.repeats} alternating runs each; {machine()}")
    with tempfile.TemporaryDirectory() as root:
        for n in args.workers:
            r = run(n, args.epochs, args.minibatch_size, args.repeats, args.copies, root)
            runs = lambda rates: ", ".join(f"{x:.0f}" for x in rates)  # noqa: E731
            print(f"  N={n}: elastic-step {statistics.median(r['ours']):8.0f} samples/s (runs {runs(r['ours'])})   "
                  f"torchrun+DDP {statistics.median(r['peer']):8.0f} samples/s (runs {runs(r['peer'])})   "
                  f"ratio {r['ratio']:.3f} (target >= 0.97)")


if __name__ == "__main__":
    main()
