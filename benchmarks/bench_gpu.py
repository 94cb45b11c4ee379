"""The GPU device check (benchmarks/gpu_check.sh runs it with --device cuda on a GPU machine):
digits with 2 workers on the device, one worker SIGKILLed mid-run, and

- the audit of the disturbed run: every row of every epoch applied exactly once;
- the recovery time, from the kill to the first step the smaller group applied (the master's
  `recovered` event, rank 0's clock, this machine's);
- the steady rows/s of an undisturbed run beside torchrun + DDP on the same device, model,
  data and per-worker batch (benchmarks/ddp_peer.py);
- the workers' NVML figures, as `elastic-step status --json` shows them.

With --device cpu it runs the same measurement on the CPU (gloo), which is how the script itself
is checked on a machine without a GPU; its figures then say nothing about GPUs."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from common import MODEL, elastic_step, job_status, machine, prepared_digits, read_steps, steady_rate, torchrun, wait_until


def collective_backend(device: str) -> str:
    """NCCL where each of the 2 workers has a GPU of its own (as GPU pods have; the Kubernetes
    backend sets it there); gloo where they share one, since NCCL refuses two ranks on one GPU
    (our step buffer then lives in host memory, one copy each way; the peer's DDP uses gloo too)."""
    import torch

    return "nccl" if device == "cuda" and torch.cuda.device_count() >= 2 else "gloo"


def worker_env(device: str) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", ELASTIC_STEP_COLLECTIVE_BACKEND=collective_backend(device))


def train(data: str, job_dir: str, device: str, epochs: int, batch: int) -> subprocess.Popen:
    os.makedirs(job_dir, exist_ok=True)
    with open(os.path.join(job_dir, "train.err"), "w") as errors:  # what the job says on its way out: shown if it fails
        return elastic_step("train", "--model-def", MODEL, "--data", data, "--job-dir", job_dir, "--workers", "1:2",
                            "--epochs", str(epochs), "--minibatch-size", str(batch), "--device", device,
                            "--audit", os.path.join(job_dir, "audit.jsonl"), "--checkpoint-steps", "0", "--no-progress",
                            env=worker_env(device), stdout=subprocess.DEVNULL, stderr=errors)


def last_words(job_dir: str) -> str:
    """The last line the job wrote on its standard error (the one that says why it ended)."""
    with open(os.path.join(job_dir, "train.err")) as f:
        lines = [line.strip() for line in f if line.strip()]
    return lines[-1] if lines else "(nothing on its standard error)"


def recovered_after(job_dir: str, moment: float) -> float | None:
    with open(os.path.join(job_dir, "events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    return next((e["step_time"] for e in events if e["event"] == "recovered" and e["step_time"] > moment), None)


def steady_at_two(job: subprocess.Popen, job_dir: str) -> dict | None:
    """The job's status once 2 workers train at a steady rate with most of the job to come."""
    if job.poll() is not None:
        raise RuntimeError(f"the job ended (exit {job.returncode}) before 2 workers had trained 20 % of its rows: "
                           f"{last_words(job_dir)}" + ("" if job.returncode == 2 else " (raise --epochs or --copies)"))
    s = job_status(job_dir)
    return s if s and s["world_size"] == 2 and s["samples_per_s"] > 0 and 0.2 <= s["rows_done"] / s["rows_total"] <= 0.6 else None


def disturbed_run(data: str, root: str, device: str, epochs: int, batch: int) -> dict:
    """One worker SIGKILLed once the group trains at full size; recovery, audit and NVML."""
    from elastic_step.audit import audit_report

    job_dir = os.path.join(root, "disturbed")
    job = train(data, job_dir, device, epochs, batch)
    try:
        seen = wait_until(lambda: steady_at_two(job, job_dir), 180,
                          "2 workers training between 20 % and 60 % of the job's rows (raise --epochs or --copies)")
        victim = next(w for w in seen["workers"] if w["rank"] == 1)
        killed_at = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        recovery = wait_until(lambda: recovered_after(job_dir, killed_at), 60, "no recovery") - killed_at
        code = job.wait(900)
    finally:
        if job.poll() is None:
            job.kill()
    audit = audit_report(os.path.join(job_dir, "audit.jsonl"), data, epochs)
    gpus = [g for w in seen["workers"] for g in (w.get("resources") or {}).get("gpus", [])]
    return {"exit": code, "recovery_s": recovery, "audit": audit, "gpus": gpus}


def steady_rates(data: str, root: str, device: str, epochs: int, batch: int) -> tuple[float, float]:
    job_dir = os.path.join(root, "clean")
    assert train(data, job_dir, device, epochs, batch).wait() == 0, f"elastic-step failed: {last_words(job_dir)}"
    ours = steady_rate(read_steps(os.path.join(job_dir, "metrics.jsonl")))
    log = os.path.join(root, "ddp.jsonl")
    peer = torchrun("--standalone", "--nproc-per-node", "2", os.path.join(os.path.dirname(__file__), "ddp_peer.py"),
                    "--model-def", MODEL, "--data", data, "--epochs", str(epochs), "--minibatch-size", str(batch),
                    "--device", device, "--backend", collective_backend(device), "--step-log", log, env=worker_env(device),
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert peer.wait() == 0, "torchrun peer failed"
    return ours, steady_rate(read_steps(log))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--epochs", type=int, default=20, help="enough for the kill to land mid-run (default %(default)s)")
    parser.add_argument("--minibatch-size", type=int, default=64)
    parser.add_argument("--copies", type=int, default=20, help="digits rows repeated (with noise) this many times")
    args = parser.parse_args()
    print(f"gpu check: digits x{args.copies}, 2 workers, --device {args.device}, {collective_backend(args.device)} between "
          f"them, minibatch {args.minibatch_size}; {machine()}")
    with tempfile.TemporaryDirectory() as root:
        data = prepared_digits(root, args.copies)
        disturbed = disturbed_run(data, root, args.device, args.epochs, args.minibatch_size)
        ours, peer = steady_rates(data, root, args.device, args.epochs, args.minibatch_size)
    audit = disturbed["audit"]
    print(f"  one worker SIGKILLed: exit {disturbed['exit']}, recovery {disturbed['recovery_s']:.3f} s, audit "
          f"{'exact' if audit['exact'] else 'NOT EXACT'} ({audit['rows_applied']} of {audit['rows_expected']} rows, "
          f"{audit['missing']} missing, {audit['repeated']} repeated)")
    print(f"  steady: elastic-step {ours:.0f} samples/s   torchrun+DDP {peer:.0f} samples/s   ratio {ours / peer:.3f}")
    for gpu in disturbed["gpus"]:
        print(f"  NVML (status --json): GPU {gpu['index']} {gpu.get('name', '')}: {gpu['utilization_percent']:.0f}% busy, "
              f"{gpu['memory_used_bytes'] / 2**20:.0f} of {gpu['memory_total_bytes'] / 2**20:.0f} MiB")
    if args.device == "cuda" and not disturbed["gpus"]:
        print("  NVML: no GPU figures in status --json (is nvidia-ml-py installed?)")
    if disturbed["exit"] != 0 or not audit["exact"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
