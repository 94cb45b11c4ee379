"""Steady-state samples/s of `elastic-step train` with its shards in an S3 server ÷ the same job
reading them from local disk (target: ratio >= 0.9).

The S3 server is moto's (the one the tests use) on 127.0.0.1, in its own process; the workers
reach it through AWS_ENDPOINT_URL and the AWS_* keys alone, as pods reach MinIO on a cluster.
Each run starts with a cold row-group cache, and one epoch over digits tiled --copies times is
hundreds of steps, so the S3 figure includes every shard's first read. The two are run
alternately, --repeats times each, and the medians compared."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

from bench_throughput import step_breakdown
from common import MODEL, elastic_step, machine, prepared_digits, read_steps, steady_rate

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from stores import S3Server, upload_folder  # noqa: E402  (the tests' server, started the same way)


def train_once(data: str, workers: int, epochs: int, batch: int, per_task: int, job_dir: str, env: dict,
               breakdowns: list) -> float:
    job = elastic_step("train", "--model-def", MODEL, "--data", data, "--job-dir", job_dir, "--workers", str(workers),
                       "--epochs", str(epochs), "--minibatch-size", str(batch), "--minibatches-per-task", str(per_task),
                       "--checkpoint-steps", "0", "--no-progress", stdout=subprocess.DEVNULL, env=env)
    assert job.wait() == 0, f"training failed; see {job_dir}/logs"
    breakdowns.append(step_breakdown(job_dir))
    return steady_rate(read_steps(os.path.join(job_dir, "metrics.jsonl")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--minibatch-size", type=int, default=64)
    parser.add_argument("--minibatches-per-task", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, alternating; medians are compared")
    parser.add_argument("--copies", type=int, default=40, help="digits rows repeated (with noise) this many times")
    args = parser.parse_args()
    print(f"remote data: digits MLP (x{args.copies} rows, 4,096-row shards), {args.workers} workers, minibatch "
          f"{args.minibatch_size}, {args.minibatches_per_task} minibatches per task, {args.epochs} epoch(s), "
          f"{args.repeats} alternating runs each; S3: moto server on 127.0.0.1; {machine()}")
    server = S3Server().start()
    try:
        with tempfile.TemporaryDirectory() as root:
            local = prepared_digits(root, args.copies)
            server.create_bucket("bench")
            s3_env = dict(os.environ, **server.env())
            remote = "s3://bench/digits"
            os.environ.update(server.env())
            upload_folder(local, remote)
            rates = {"local": [], "s3": []}
            phases = {"local": [], "s3": []}
            for i in range(args.repeats):
                for name, data, env in (("local", local, dict(os.environ)), ("s3", remote, s3_env)):
                    rates[name].append(train_once(data, args.workers, args.epochs, args.minibatch_size,
                                                  args.minibatches_per_task, os.path.join(root, f"{name}-{i}"), env, phases[name]))
            here, there = statistics.median(rates["local"]), statistics.median(rates["s3"])
            runs = lambda xs: ", ".join(f"{x:.0f}" for x in xs)  # noqa: E731
            print(f"  shards in S3 {there:8.0f} samples/s (runs {runs(rates['s3'])})   "
                  f"local disk {here:8.0f} samples/s (runs {runs(rates['local'])})   "
                  f"ratio {there / here:.3f} (target >= 0.9)")
            for name in ("s3", "local"):
                found = [b for b in phases[name] if b]
                if found:
                    parts = ", ".join(f"{p} {statistics.median(b.get(p, 0.0) for b in found):.2f}" for p in found[0])
                    print(f"    {name:5} per step, median of runs (ms): {parts}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
