"""CTR training on parameter-server shards under worker kills: quality and exactly-once.

The PyTorch DeepFM (model_zoo/deepfm_ps_torch: its embedding table on the shards) on the
synthetic Criteo-shaped data (`prepare-data --source synthetic:criteo`), trained with
`train --mode ps`: clean, `--clean-runs` times, then with a worker SIGKILLed at random every
`--period` seconds until `--kills` kills (a replacement is launched after each), same data,
seed and settings. For every run:

- the test AUC and log loss the job recorded (result.json): the killed run beside the clean ones
  (target: AUC within +/- 0.003 of the clean run; the clean runs' own spread is printed, since
  which worker trains which task, and so the order of the updates, differs from run to run);
- every embedding row's update counter on the shards after the job (their last snapshots) against
  the count computed from the data alone (ps.expected_updates): each minibatch updates each of
  its distinct ids once (target: zero mismatches, killed or not).

How to compare the AUCs: one epoch over many rows, not several over few (a second pass over the
rows lets the rare ids' rows overfit, by an amount that the order of the updates decides: clean
runs then differ by 0.01); a large test split; and `--workers N:N`, so that a killed worker's
replacement is waited for and every step holds as many workers' minibatches as a clean run's
(with 2:3 a killed run trains some steps on two workers: 4 % more, smaller dense steps than a
clean run's, and on one epoch an AUC 0.004 higher; the steps column says how many each run took).

    cd benchmarks && ../.venv/bin/python bench_ctr_kills.py --rows 1600000 --split 0.6,0.04,0.36 --epochs 1 \
        --workers 3:3 --kills 20 --clean-runs 3 --killed-runs 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import elastic_step, live_pids_with_env, machine, training_worker_pids, wait_until  # noqa: E402

from elastic_step.data.manifest import load_manifest  # noqa: E402
from elastic_step.ps.expected_updates import expected_updates, updates_on_the_shards  # noqa: E402

DEEPFM_PS = "elastic_step.model_zoo.deepfm_ps_torch"
MINIBATCH = 128


def prepare(root: str, rows: int, rows_per_shard: int, split: str) -> str:
    data = os.path.join(root, "data")
    done = subprocess.run([sys.executable, "-m", "elastic_step.cli", "prepare-data", "--source",
                           f"synthetic:criteo?rows={rows}&seed=5", "--out", data, "--categorical", "auto",
                           "--rows-per-shard", str(rows_per_shard), "--split", split, "--no-progress"], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"prepare-data failed: {done.stderr.strip()}")
    return data


def first_step(job_dir: str) -> bool:
    path = os.path.join(job_dir, "metrics.jsonl")
    return os.path.exists(path) and os.path.getsize(path) > 0


def run(data: str, job_dir: str, epochs: int, kills: int, period_s: float, seed: int, timeout_s: float, workers: str) -> dict:
    """One job to its end, with `kills` worker SIGKILLs every `period_s` s (0: clean)."""
    os.makedirs(job_dir)
    args = ["train", "--model-def", DEEPFM_PS, "--data", data, "--job-dir", job_dir, "--mode", "ps", "--ps-shards", "2",
            "--workers", workers, "--epochs", str(epochs), "--minibatch-size", str(MINIBATCH), "--minibatches-per-task", "2",
            "--checkpoint-steps", "50", "--max-relaunches", "1000", "--seed", "1", "--no-progress"]
    rng, began, done_kills = random.Random(seed), time.monotonic(), 0
    with open(os.path.join(job_dir, "..", f"{os.path.basename(job_dir)}.log"), "wb") as out:
        proc = elastic_step(*args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: first_step(job_dir) or proc.poll() is not None, 300, "the job applied no step")
        next_at = time.monotonic() + period_s
        while proc.poll() is None:
            if done_kills < kills and time.monotonic() >= next_at and (pids := training_worker_pids(job_dir)):
                with contextlib.suppress(ProcessLookupError):  # it ended between the status and the signal
                    os.kill(rng.choice(pids), signal.SIGKILL)
                    done_kills += 1
                next_at = time.monotonic() + period_s
            if time.monotonic() - began > timeout_s:
                raise TimeoutError(f"the job did not finish in {timeout_s:.0f}s")
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for pid in live_pids_with_env(f"ELASTIC_STEP_TOKEN_FILE={os.path.join(job_dir, 'token')}".encode()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    if proc.returncode != 0:  # its folder goes with the temporary root: say what it said
        with open(os.path.join(job_dir, "..", f"{os.path.basename(job_dir)}.log"), encoding="utf-8", errors="replace") as f:
            tail = f.readlines()[-15:]
        raise SystemExit(f"the job exited {proc.returncode}; the end of its output:\n{''.join(tail)}")
    with open(os.path.join(job_dir, "result.json")) as f:
        result = json.load(f)
    return {"kills": done_kills, "seconds": time.monotonic() - began, "test": result["test_metrics"], "steps": result.get("steps"),
            "counters": updates_on_the_shards(job_dir, "deepfm_ids"), "relaunches": result.get("relaunches")}


def mismatches(got: Counter, expected: Counter) -> int:
    return sum(1 for i in set(got) | set(expected) if got[i] != expected[i])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=240_000, help="rows of synthetic Criteo-shaped data")
    parser.add_argument("--rows-per-shard", type=int, default=4_000)
    parser.add_argument("--split", default="0.8,0.1,0.1", help="TRAIN,VAL,TEST fractions of --rows (a larger test split "
                        "measures each run's AUC more closely: the runs' models differ on few rows)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--kills", type=int, default=20, help="worker SIGKILLs in the disturbed run")
    parser.add_argument("--period", type=float, default=3.0, help="seconds between kills")
    parser.add_argument("--workers", default="2:3", help="MIN:MAX workers (MIN = MAX: a killed worker's replacement is "
                        "waited for, so that every step has as many workers as a clean run's, and as many rows)")
    parser.add_argument("--clean-runs", type=int, default=2)
    parser.add_argument("--killed-runs", type=int, default=1, help="disturbed runs (several: the difference of the means "
                        "with its standard error, since clean runs differ among themselves)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    args = parser.parse_args()
    print(machine())
    with tempfile.TemporaryDirectory(prefix="bench-ctr-") as root:
        data = prepare(root, args.rows, args.rows_per_shard, args.split)
        manifest = load_manifest(data)
        expected = expected_updates(data, DEEPFM_PS, MINIBATCH, args.epochs)
        runs = [("clean", run(data, os.path.join(root, f"clean-{i}"), args.epochs, 0, args.period, i, args.timeout, args.workers))
                for i in range(args.clean_runs)]
        runs += [("killed", run(data, os.path.join(root, f"killed-{i}"), args.epochs, args.kills, args.period, 7 + i, args.timeout,
                             args.workers))
                 for i in range(args.killed_runs)]
    print(f"DeepFM on 2 parameter-server shards, {manifest.rows('train'):,} training rows x {args.epochs} epochs, "
          f"{manifest.rows('test'):,} test rows, minibatch {MINIBATCH}, "
          f"workers {args.workers}; {sum(expected.values()):,} row updates expected over {len(expected):,} ids")
    print(f"{'run':8} {'kills':>5} {'seconds':>8} {'steps':>6} {'test AUC':>9} {'log loss':>9} {'counter mismatches':>19}")
    for name, r in runs:
        print(f"{name:8} {r['kills']:5d} {r['seconds']:8.1f} {r['steps'] or 0:6d} {r['test']['auc']:9.4f} {r['test'].get('log_loss', float('nan')):9.4f} "
              f"{mismatches(r['counters'], expected):19d}")
    summary(*([r["test"]["auc"] for name, r in runs if name == kind] for kind in ("clean", "killed")))


def summary(clean: list[float], killed: list[float]) -> None:
    """The killed runs' mean AUC against the clean runs', with the standard error of that
    difference from the runs' own spread (which worker trains which task, and so the order of
    the updates, differs from run to run, killed or not)."""
    difference = statistics.fmean(killed) - statistics.fmean(clean)
    variance = sum(statistics.variance(group) / len(group) for group in (clean, killed) if len(group) > 1)
    error = f" +/- {variance ** 0.5:.4f} (standard error)" if variance else ""
    print(f"clean AUC spread {max(clean) - min(clean):.4f}; killed mean - clean mean {difference:+.4f}{error} "
          "(target |difference| <= 0.003); counter mismatches target 0")


if __name__ == "__main__":
    main()
