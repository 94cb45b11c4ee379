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
import threading
import time

import psutil

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


class CpuSampler:
    """The CPU seconds (user + system) of one process, its children not counted, sampled with
    the time every `every_s` until it exits: the master's own CPU, which is fair under load
    where its wall time is not."""

    def __init__(self, pid: int, every_s: float = 0.1):
        self.samples: list[tuple[float, float]] = []
        self._process = psutil.Process(pid)
        self._every_s = every_s
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                cpu = self._process.cpu_times()
                self.samples.append((time.time(), cpu.user + cpu.system))
                time.sleep(self._every_s)
        except psutil.Error:  # it has exited
            return

    def at(self, moment: float) -> float:
        """CPU seconds used by `moment`: the last sample taken at or before it."""
        before = [cpu for t, cpu in self.samples if t <= moment]
        return before[-1] if before else 0.0

    def join(self) -> None:
        self._thread.join(5)


def master_cpu_per_step(sampler: CpuSampler, steps: list[dict]) -> float:
    """The master's CPU seconds per applied step, from its first applied step to its last (so
    neither start-up nor the final evaluation and upload count)."""
    times = sorted(s["time"] for s in steps)
    return (sampler.at(times[-1]) - sampler.at(times[0])) / max(len(times) - 1, 1)


def ours_once(data: str, workers: int, epochs: int, batch: int, job_dir: str, model: str = MODEL) -> tuple[float, float]:
    """Steady samples/s and the master's CPU seconds per applied step."""
    ours = elastic_step("train", "--model-def", model, "--data", data, "--job-dir", job_dir, "--workers", str(workers),
                        "--epochs", str(epochs), "--minibatch-size", str(batch), "--minibatches-per-task", "16", "--checkpoint-steps", "0",
                        "--no-progress", stdout=subprocess.DEVNULL)
    sampler = CpuSampler(ours.pid)
    assert ours.wait() == 0, f"elastic-step training failed; see {job_dir}/logs"
    sampler.join()
    steps = read_steps(os.path.join(job_dir, "metrics.jsonl"))
    return steady_rate(steps), master_cpu_per_step(sampler, steps)


def peer_once(data: str, workers: int, epochs: int, batch: int, log: str, model: str = MODEL) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1")  # what torchrun sets for several workers per node, and our local backend too
    peer = torchrun("--standalone", "--nproc-per-node", str(workers), os.path.join(os.path.dirname(__file__), "ddp_peer.py"),
                    "--model-def", model, "--data", data, "--epochs", str(epochs), "--minibatch-size", str(batch),
                    "--step-log", log, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert peer.wait() == 0, "torchrun peer failed"
    return steady_rate(read_steps(log))


def run(workers: int, epochs: int, batch: int, repeats: int, copies: int, root: str, model: str = MODEL,
        with_peer: bool = True) -> dict:
    data = prepared_digits(root, copies)
    ours, peer, breakdowns, master_cpu = [], [], [], []
    for i in range(repeats):
        job_dir = os.path.join(root, f"elastic-{workers}-{i}")
        rate, cpu = ours_once(data, workers, epochs, batch, job_dir, model)
        ours.append(rate)
        master_cpu.append(cpu)
        breakdowns.append(step_breakdown(job_dir))
        if with_peer:
            peer.append(peer_once(data, workers, epochs, batch, os.path.join(root, f"ddp-{workers}-{i}.jsonl"), model))
    phases = breakdowns[0].keys() if breakdowns and breakdowns[0] else []
    return {"workers": workers, "ours": ours, "peer": peer, "master_cpu": master_cpu,
            "ratio": statistics.median(ours) / statistics.median(peer) if peer else None,
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
    parser.add_argument("--no-peer", action="store_true", help="elastic-step alone (its rate, breakdown and master CPU)")
    args = parser.parse_args()
    print(f"throughput: {args.model} digits MLP (x{args.copies} rows), minibatch {args.minibatch_size} per worker, {args.epochs} epochs, "
          f"{args.repeats} alternating runs each; {machine()}")
    with tempfile.TemporaryDirectory() as root:
        for n in args.workers:
            r = run(n, args.epochs, args.minibatch_size, args.repeats, args.copies, root, MODELS[args.model], not args.no_peer)
            runs = lambda rates: ", ".join(f"{x:.0f}" for x in rates)  # noqa: E731
            print(f"  N={n}: elastic-step {statistics.median(r['ours']):8.0f} samples/s (runs {runs(r['ours'])})"
                  + (f"   torchrun+DDP {statistics.median(r['peer']):8.0f} samples/s (runs {runs(r['peer'])})   "
                     f"ratio {r['ratio']:.3f} (target >= 0.97)" if r["peer"] else ""))
            cpu = ", ".join(f"{1000 * x:.2f}" for x in r["master_cpu"])
            print(f"        master CPU per applied step (ms, its own process, first to last step): "
                  f"median {1000 * statistics.median(r['master_cpu']):.2f} (runs {cpu}); load {os.getloadavg()[0]:.1f}")
            if r["breakdown"]:
                parts = ", ".join(f"{phase} {ms:.2f}" for phase, ms in r["breakdown"].items())
                print(f"        elastic-step per step, median of runs (ms): {parts}; total {sum(r['breakdown'].values()):.2f}")


if __name__ == "__main__":
    main()
