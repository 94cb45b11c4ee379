"""Goodput under a steady rate of disturbance: the same job run clean, then disturbed; goodput is
the clean wall time divided by the disturbed wall time, both from the first applied step to the
last, over the same rows. Targets: >= 0.90 under a worker SIGKILL every 10 s, and lost time
(1 - goodput) at most a quarter of the peer's.

Disturbances (each in a run of its own):
  kill10, kill30  a live worker, drawn at random, SIGKILLed every 10 s (30 s);
  term10          a live worker SIGTERMed every 10 s (an eviction of one pod);
  master60        the job's launcher SIGTERMed every 60 s (a preemption of the step) and the same
                  command run again at once, as a pipeline's retry runs it.

elastic-step: `train --workers 2:3` (the group shrinks and grows back), checkpoints only when
preempted; run twice, alternating: its workers forked from a warm parent that has imported torch
("es+forks", the default), whose replacements take almost none of the survivors' CPU to start, and
started as programs ("elastic-step", ELASTIC_STEP_LOCAL_FORKS=0). Peer: torchrun as a one-node user runs it (`--standalone --max-restarts`) + DDP
(`ddp_peer.py`), a checkpoint every 50 steps from which every restart resumes. Both: the MLP
64 -> 512 -> 512 -> 10 (`mlp512_digits.py`), the same data, 3 workers of 64 rows per step.

`--startup-cpu N` measures only the CPU seconds a replacement spends from its start to its first
round, N kills of each variant: on 2 cores that the survivors keep busy, a kill costs about half of
that in progress, and unlike a rate on a shared machine it does not move with the load.

Runs alternate (ours, peer, ours, peer): on a shared machine the rate moves from one minute to
the next, so the load average is printed beside every figure."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from common import elastic_step, live_pids_with_env, machine, prepared_digits, read_steps, torchrun, training_worker_pids, wait_until

MLP512 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mlp512_digits.py")
WORKERS = 3
MINIBATCH = 64
PEER_CHECKPOINT_EVERY = 50
RETRIES = 5  # a job that fails under disturbance is run again (it resumes), as a pipeline's retry does


@dataclasses.dataclass(frozen=True)
class Disturbance:
    target: str  # "worker" or "master"
    signal: signal.Signals
    period_s: float


DISTURBANCES = {
    "kill10": Disturbance("worker", signal.SIGKILL, 10.0),
    "kill30": Disturbance("worker", signal.SIGKILL, 30.0),
    "term10": Disturbance("worker", signal.SIGTERM, 10.0),
    "master60": Disturbance("master", signal.SIGTERM, 60.0),
}


class ElasticStep:
    name = "elastic-step"
    forks = "0"  # its workers started as programs

    def __init__(self, data: str, epochs: int, job_dir: str):
        self.job_dir = job_dir
        # A checkpoint every 50 steps, as the peer's: what the master restores the group from, in
        # process, if every worker that held the model is killed before a replacement has it (a
        # preemption checkpoints too).
        self.args = ["train", "--model-def", MLP512, "--data", data, "--job-dir", job_dir, "--workers", f"2:{WORKERS}",
                     "--epochs", str(epochs), "--minibatch-size", str(MINIBATCH), "--minibatches-per-task", "16",
                     "--checkpoint-steps", str(PEER_CHECKPOINT_EVERY), "--max-relaunches", "1000", "--no-progress"]

    def start(self) -> subprocess.Popen:
        with open(os.path.join(self.job_dir, "output.log"), "ab") as out:
            return elastic_step(*self.args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, ELASTIC_STEP_LOCAL_FORKS=self.forks))

    def steps(self) -> list[dict]:
        path = os.path.join(self.job_dir, "metrics.jsonl")
        return read_steps(path) if os.path.exists(path) else []

    def workers(self) -> list[int]:
        return live_pids_with_env(f"ELASTIC_STEP_TOKEN_FILE={os.path.join(self.job_dir, 'token')}".encode())

    def victims(self) -> list[int]:
        """The workers training in its current round (the peer's victims, too, are workers in its group)."""
        return training_worker_pids(self.job_dir)


class ElasticStepForks(ElasticStep):
    """The same, its workers forked from a warm parent that has imported what they import
    (the default): a replacement's start-up takes little CPU from the survivors."""

    name = "es+forks"
    forks = "1"


OURS = {"plain": ElasticStep, "forks": ElasticStepForks}


class TorchrunDDP:
    name = "torchrun+DDP"

    def __init__(self, data: str, epochs: int, job_dir: str):
        self.job_dir = job_dir
        self.log, self.pids, ckpt = (os.path.join(job_dir, n) for n in ("steps.jsonl", "pids", "ckpt"))
        for path in (self.pids, ckpt):
            os.makedirs(path, exist_ok=True)
        self.args = ["--standalone", "--nproc-per-node", str(WORKERS), "--max-restarts", "1000",
                     os.path.join(os.path.dirname(os.path.abspath(__file__)), "ddp_peer.py"), "--model-def", MLP512,
                     "--data", data, "--epochs", str(epochs), "--minibatch-size", str(MINIBATCH), "--step-log", self.log,
                     "--checkpoint-dir", ckpt, "--checkpoint-every", str(PEER_CHECKPOINT_EVERY), "--pid-dir", self.pids]

    def start(self) -> subprocess.Popen:
        env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
        with open(os.path.join(self.job_dir, "output.log"), "ab") as out:
            return torchrun(*self.args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def steps(self) -> list[dict]:
        return read_steps(self.log) if os.path.exists(self.log) else []

    def workers(self) -> list[int]:
        pids = []
        for name in os.listdir(self.pids):
            try:
                with open(os.path.join(self.pids, name)) as f:
                    pid = int(f.read())
                os.kill(pid, 0)
                pids.append(pid)
            except (OSError, ValueError):
                continue
        return pids

    def victims(self) -> list[int]:
        return self.workers()  # a worker writes its pid once it is in the group


def wall(steps: list[dict]) -> float:
    """From the first applied step to the last (a disturbed peer redoes steps after each restart:
    its log's last line is still the job's end)."""
    times = [s["time"] for s in steps]
    return max(times) - min(times)


def where_it_went(steps: list[dict], clean_seconds: float) -> str:
    """elastic-step's lost seconds (disturbed wall time less the clean run's), split exactly by its
    step log, whose lines name their round and world size: the gaps from a round's last step to
    the next round's first, after a member was lost (the world shrank), for a joiner (it grew
    back) or across a failed job's retry (a new master, whose rounds count from 1); and the rounds themselves, at full size and smaller, each against the clean run's
    rows/s (a full-size round runs slower while a replacement starts up beside it on the cores)."""
    steps = sorted(steps, key=lambda s: s["time"])
    rate = sum(s["samples"] for s in steps) / clean_seconds
    full = max(s["world_size"] for s in steps)
    parts = {"retries after a failure": 0.0, "regroups after a loss": 0.0, "regroups for a joiner": 0.0, "regroups at the same size": 0.0,
             "full-size rounds": 0.0, "smaller rounds": 0.0}
    counts = dict.fromkeys(parts, 0)
    start = 0
    for i in range(1, len(steps) + 1):
        if i < len(steps) and steps[i]["round"] == steps[start]["round"]:
            continue
        span, rows = steps[i - 1]["time"] - steps[start]["time"], sum(s["samples"] for s in steps[start:i])
        kind = "full-size rounds" if steps[start]["world_size"] == full else "smaller rounds"
        parts[kind] += span - rows / rate
        counts[kind] += 1
        if i < len(steps):
            before, after = steps[i - 1]["world_size"], steps[i]["world_size"]
            kind = ("retries after a failure" if steps[i]["round"] < steps[i - 1]["round"]  # a new master counts from 1
                    else "regroups after a loss" if after < before else "regroups for a joiner" if after > before
                    else "regroups at the same size")
            parts[kind] += steps[i]["time"] - steps[i - 1]["time"]
            counts[kind] += 1
        start = i
    return ", ".join(f"{name} {seconds:.1f} s ({counts[name]})" for name, seconds in parts.items() if counts[name])


def output_tail(job_dir: str) -> str:
    with open(os.path.join(job_dir, "output.log"), errors="replace") as f:
        return " | ".join(f.read().splitlines()[-5:])


def first_step(system, proc: subprocess.Popen) -> float | None:
    steps = system.steps()
    if not steps and proc.poll() is not None:
        raise RuntimeError(f"{system.name} exited {proc.returncode} before its first step")
    return steps[0]["time"] if steps else None


def run_job(system, disturbance: Disturbance | None, seed: int, timeout_s: float) -> tuple[float, int, int]:
    """Run the job to its end under `disturbance` (None: clean); its wall time, the number of
    disturbances applied and of retries after a failure (each resumes from the newest checkpoint)."""
    rng = random.Random(seed)
    proc = system.start()
    deadline = time.monotonic() + timeout_s
    try:
        first = wait_until(lambda: first_step(system, proc), 300, f"{system.name} applied no step")
        next_at, count, retries, preempted = (first + disturbance.period_s if disturbance else None), 0, 0, False
        while True:
            code = proc.poll()
            if code == 0:
                break
            if code is not None:
                if not preempted:  # a failure: retried a bounded number of times, never when clean
                    retries += 1
                    if disturbance is None or retries > RETRIES:
                        raise RuntimeError(f"{system.name} exited {code}: {output_tail(system.job_dir)}")
                proc, preempted = system.start(), False  # the retry: the same command again
            elif next_at is not None and time.time() >= next_at:
                next_at += disturbance.period_s
                if disturbance.target == "master":
                    proc.send_signal(disturbance.signal)
                    proc.wait(120)
                    preempted = True
                    count += 1
                elif victims := system.victims():
                    try:
                        os.kill(rng.choice(victims), disturbance.signal)
                        count += 1
                    except ProcessLookupError:  # it ended between the status and the signal
                        pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{system.name} did not finish in {timeout_s:.0f}s")
            time.sleep(0.05)
    finally:
        if proc.poll() != 0:  # the launcher and whatever it started (its session): nothing outlives a failed run
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            for pid in system.workers():  # torchrun starts each worker in a session of its own
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    return wall(system.steps()), count, retries


def cpu_seconds(pid: int) -> float | None:
    """The process's user + system CPU time so far (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def startup_cpu(kind, data: str, root: str, kills: int) -> list[float]:
    """CPU seconds each of `kills` replacements spends from its start to its first round: what a
    kill takes from the survivors' cores, whatever the load (a rate on a busy machine is noise)."""
    job_dir = os.path.join(root, f"{kind.name}-startup-cpu")
    shutil.rmtree(job_dir, ignore_errors=True)
    os.makedirs(job_dir)
    system = kind(data, 1000, job_dir)
    proc = system.start()
    seconds = []
    try:
        from elastic_step.operate.client import try_status

        for _ in range(kills):
            full = wait_until(lambda: (s := try_status(system.job_dir)) and s["round_ready"] and s["world_size"] == WORKERS and s,
                              600, "a full group")
            victim = next(w for w in full["workers"] if w["rank"] == 1 and w["state"] == "live")
            os.kill(victim["pid"], signal.SIGKILL)
            seen: dict = {}

            def ready_replacement():
                status = try_status(system.job_dir) or {"workers": [], "round_ready": False}
                for w in status["workers"]:
                    if w["slot"] == victim["slot"] and w["id"] != victim["id"] and w.get("pid"):
                        seen["cpu"] = cpu_seconds(w["pid"]) or seen.get("cpu")
                        if w["rank"] is not None and status["round_ready"]:
                            return seen["cpu"]
                return None

            seconds.append(wait_until(ready_replacement, 600, "the replacement in a round"))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return seconds


def load() -> str:
    return "load {:.1f}".format(os.getloadavg()[0])


def measure(kind, data: str, epochs: int, name: str, disturbance: Disturbance | None, root: str, seed: int,
            timeout_s: float) -> tuple[float, int, int, str, list[dict]]:
    """The wall time, the disturbances, the retries, the load average and the step log of one run."""
    job_dir = os.path.join(root, f"{kind.name}-{name}-{seed}")
    shutil.rmtree(job_dir, ignore_errors=True)
    os.makedirs(job_dir)
    system = kind(data, epochs, job_dir)
    seconds, count, retries = run_job(system, disturbance, seed, timeout_s)
    return seconds, count, retries, load(), system.steps()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--disturbances", nargs="+", choices=sorted(DISTURBANCES), default=["kill10", "kill30", "term10", "master60"])
    parser.add_argument("--copies", type=int, default=40, help="digits rows repeated (with noise) this many times")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=1, help="alternating runs of each; goodput medians are compared")
    parser.add_argument("--no-peer", action="store_true", help="elastic-step only")
    parser.add_argument("--ours", nargs="+", choices=sorted(OURS), default=["plain", "forks"],
                        help="elastic-step's variants: workers started as programs (plain), forked from a warm parent (forks)")
    parser.add_argument("--quick", action="store_true", help="4 epochs, a worker SIGKILL every 10 s only")
    parser.add_argument("--startup-cpu", type=int, metavar="N",
                        help="only measure each variant's replacement start-up CPU, over N kills (load-independent)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one job may take")
    parser.add_argument("--keep", metavar="DIR", help="put the data and the jobs' folders (events, logs) here and keep them")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still cleans up
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    if args.quick:
        args.copies, args.epochs, args.disturbances = 40, 4, ["kill10"]
    ours = [OURS[name] for name in args.ours]
    kinds = ours + ([] if args.no_peer else [TorchrunDDP])
    print(f"goodput: MLP 64-512-512-10, digits x{args.copies}, {args.epochs} epochs, {WORKERS} workers x {MINIBATCH} rows; "
          f"{args.repeats} alternating runs; {machine()}", flush=True)
    with (contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory()) as root:
        data = prepared_digits(root, args.copies)
        if args.startup_cpu:
            for kind in ours:
                spent = startup_cpu(kind, data, root, args.startup_cpu)
                print(f"  {kind.name:13s} a replacement's CPU from its start to its first round: "
                      f"{' '.join(f'{s:.2f}' for s in spent)} s  ({load()})", flush=True)
            return
        clean = {k.name: [] for k in kinds}
        for seed in range(args.repeats):
            for kind in kinds:
                seconds, _, _, at, _ = measure(kind, data, args.epochs, "clean", None, root, seed, args.timeout)
                clean[kind.name].append(seconds)
                print(f"  clean  {kind.name:13s} {seconds:7.2f} s  ({at})", flush=True)
        table = []
        for name in args.disturbances:
            goodput: dict[str, list[float]] = {k.name: [] for k in kinds}
            lost: dict[str, list[float]] = {k.name: [] for k in kinds}
            for seed in range(args.repeats):
                for kind in kinds:
                    try:
                        seconds, count, retries, at, steps = measure(kind, data, args.epochs, name, DISTURBANCES[name],
                                                                     root, seed, args.timeout)
                    except (RuntimeError, TimeoutError) as exc:  # the table says so; the other runs go on
                        print(f"  {name:6s} {kind.name:13s} did not finish: {exc}  ({load()})", flush=True)
                        goodput[kind.name].append(float("nan"))
                        lost[kind.name].append(float("nan"))
                        continue
                    base = clean[kind.name][seed]
                    goodput[kind.name].append(base / seconds)
                    lost[kind.name].append((seconds - base) / max(count, 1))
                    print(f"  {name:6s} {kind.name:13s} {seconds:7.2f} s, {count} disturbances: goodput {base / seconds:.3f}, "
                          f"{(seconds - base) / max(count, 1):.2f} s lost per disturbance, {retries} retries after a failure  "
                          f"({at})", flush=True)
                    if kind in ours:
                        print(f"         lost {seconds - base:.1f} s: {where_it_went(steps, base)}", flush=True)
            theirs = None if args.no_peer else statistics.median(goodput[TorchrunDDP.name])
            if theirs is not None:
                print(f"  => {name}: torchrun+DDP goodput {theirs:.3f} ({statistics.median(lost[TorchrunDDP.name]):.2f} s per disturbance)")
            for kind in ours:
                mine = statistics.median(goodput[kind.name])
                line = f"  => {name}: {kind.name} goodput {mine:.3f} ({statistics.median(lost[kind.name]):.2f} s per disturbance)"
                if theirs is not None:
                    share = (1 - mine) / (1 - theirs) if theirs < 1 else float("nan")
                    line += f"; lost time ours/theirs {share:.2f} (target <= 0.25)"
                print(line + ("  (target >= 0.90)" if name == "kill10" else ""), flush=True)
            table.append((name, goodput, lost))
        summary(table, [k.name for k in kinds], peer=not args.no_peer)


def summary(table: list[tuple[str, dict, dict]], names: list[str], peer: bool) -> None:
    """Every disturbance's medians in one table (goodput, and seconds lost per disturbance), and
    each of our variants' lost time against the peer's (the last name, when there is a peer)."""
    ours = names[:-1] if peer else names
    print("\n| disturbance | " + " | ".join(f"{n} goodput | {n} s lost each" for n in names) + " | lost time ours/peer |")
    print("|---" * (2 * len(names) + 2) + "|")
    for name, goodput, lost in table:
        cells = [f"{statistics.median(goodput[n]):.3f} | {statistics.median(lost[n]):.2f}" for n in names]
        theirs = statistics.median(goodput[names[-1]])
        shares = " / ".join(f"{(1 - statistics.median(goodput[n])) / (1 - theirs):.2f}" for n in ours) if peer and theirs < 1 else "-"
        print(f"| {name} | " + " | ".join(cells) + f" | {shares} |")


if __name__ == "__main__":
    sys.exit(main())
