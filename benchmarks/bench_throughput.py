"""Steady-state samples/s of elastic-step against torchrun + DDP with the same number of
workers, model, data and per-worker minibatch size (target: ratio >= 0.97)."""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

from common import MODEL, elastic_step, machine, prepared_digits, read_steps, steady_rate, torchrun


def run(workers: int, epochs: int, batch: int, root: str) -> dict:
    data = prepared_digits(root)
    job_dir = os.path.join(root, f"elastic-{workers}")
    ours = elastic_step("train", "--model-def", MODEL, "--data", data, "--job-dir", job_dir, "--workers", str(workers),
                        "--epochs", str(epochs), "--minibatch-size", str(batch), "--minibatches-per-task", "16", "--checkpoint-steps", "0",
                        "--no-progress", stdout=subprocess.DEVNULL)
    assert ours.wait() == 0, "elastic-step training failed"
    ours_rate = steady_rate(read_steps(os.path.join(job_dir, "metrics.jsonl")))
    log = os.path.join(root, f"ddp-{workers}.jsonl")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    peer = torchrun("--standalone", "--nproc-per-node", str(workers), os.path.join(os.path.dirname(__file__), "ddp_peer.py"),
                    "--model-def", MODEL, "--data", data, "--epochs", str(epochs), "--minibatch-size", str(batch),
                    "--step-log", log, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert peer.wait() == 0, "torchrun peer failed"
    peer_rate = steady_rate(read_steps(log))
    return {"workers": workers, "elastic_step": ours_rate, "torchrun_ddp": peer_rate, "ratio": ours_rate / peer_rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, nargs="+", default=[2])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--minibatch-size", type=int, default=64)
    args = parser.parse_args()
    print(f"throughput: digits MLP, minibatch {args.minibatch_size} per worker, {args.epochs} epochs; {machine()}")
    with tempfile.TemporaryDirectory() as root:
        for n in args.workers:
            r = run(n, args.epochs, args.minibatch_size, root)
            print(f"  N={n}: elastic-step {r['elastic_step']:8.0f} samples/s   torchrun+DDP {r['torchrun_ddp']:8.0f} samples/s"
                  f"   ratio {r['ratio']:.3f} (target >= 0.97)")


if __name__ == "__main__":
    main()
