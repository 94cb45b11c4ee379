"""Time from SIGKILL of one of N workers to the next applied step: elastic-step (survivors
regroup in process) against torchrun run as a one-node user runs it (`--standalone
--max-restarts`: every worker restarts and resumes from a checkpoint saved every 50 steps).
Targets: <= 0.5 s, and <= 1/15 of torchrun's. `--torchrun multinode` measures the elastic
multi-node form instead (see MULTI_NODE for why that is not the peer)."""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from common import MODEL, elastic_step, job_status, machine, prepared_digits, read_steps, torchrun, wait_until

MODELS = {
    "small": MODEL,
    "wide": os.path.join(os.path.dirname(os.path.abspath(__file__)), "wide_digits.py"),  # 8.6M parameters
}
TRANSFER = re.compile(r"round (\d+): state of rank \d+ sent to ranks (.*) \((\d+) bytes\) in ([\d.]+) s")


def recovery_split(job_dir: str, killed_at: float) -> dict[str, float]:
    """Where one recovery's seconds went, from the job's events and its workers' logs:
    detection (kill -> the regroup's round proposed), regroup (-> every member called in and the
    ledger settled), state transfer (the slowest member's, as its log says), first step (the
    rest, to the first applied step)."""
    with open(os.path.join(job_dir, "events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    proposed = next(e for e in events if e["event"] == "round_proposed" and e["time"] > killed_at)
    # The round that trained again: the smaller group's, or, when the replacement joined before that
    # round's first step, the one with it that took over (it carries the kill's recovery).
    recovered = next(e for e in events if e["event"] == "recovered" and e["step_time"] > killed_at)
    regrouped = next(e for e in events if e["event"] == "regrouped" and e["round"] == recovered["round"])
    transfer, sent_to = 0.0, "?"
    for path in glob.glob(os.path.join(job_dir, "logs", "w*.log")):
        for line in open(path):
            m = TRANSFER.search(line)
            if m and int(m.group(1)) == regrouped["round"]:
                transfer, sent_to = max(transfer, float(m.group(4))), m.group(2)
    first_step = recovered["step_time"] - regrouped["time"]
    return {"detection": proposed["time"] - killed_at, "regroup": regrouped["time"] - proposed["time"],
            "state transfer": transfer, "first step": first_step - transfer, "sent to": sent_to}


MINIBATCH = 32  # rows per worker per step


class AuditWatcher:
    """Reads the job's audit file from outside, as someone checking it would, every 10 ms: when
    each step's lines first appeared there, and how many rows it consumed (a line is one consumed
    range, and a rank's minibatch may span two tasks: rows, not lines, tell a smaller group). The
    audit holds final steps only, so this is later than the step's own time by the audit's lag."""

    def __init__(self, path: str):
        self.path = path
        self.steps: dict[int, tuple[float, int]] = {}  # step -> (first seen, rows)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        offset, partial = 0, ""
        while not self._stop.wait(0.01):
            try:
                with open(self.path) as f:
                    f.seek(offset)
                    text = f.read()
            except FileNotFoundError:
                continue
            offset += len(text.encode())
            now = time.time()
            lines = (partial + text).split("\n")
            partial = lines.pop()
            for line in lines:
                entry = json.loads(line) if line.strip() else {}
                if "step" in entry:
                    seen, rows = self.steps.get(entry["step"], (now, 0))
                    self.steps[entry["step"]] = (seen, rows + entry["count"])

    def first_smaller_step(self, after: float, full_rows: int) -> float | None:
        """When the audit first showed a step of fewer than `full_rows` rows (a smaller group's),
        seen after `after`."""
        times = [seen for seen, rows in self.steps.values() if seen > after and rows < full_rows]
        return min(times) if times else None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)


def first_step_after(log: str, moment: float) -> float | None:
    if not os.path.exists(log):
        return None
    later = [s["time"] for s in read_steps(log) if s["time"] > moment]
    return min(later) if later else None


def elastic_recovery(workers: int, data: str, root: str, kills: int, model: str = MODEL, splits: list | None = None,
                     spares: int | None = None, outside: list | None = None) -> list[float]:
    """An elastic group (2:N) by default; with `spares`, a fixed group of N with that many warm
    spares (0: a fixed group that waits for the relaunch of whoever died). The job's own figure
    (the recovered event's step time) for each kill; with `outside`, the elastic group's figure
    seen from outside as well: the smaller group's first step appearing in the audit file."""
    job_dir = os.path.join(root, "elastic" if spares is None else f"fixed-spares-{spares}")
    group = [f"2:{workers}"] if spares is None else [str(workers), "--spares", str(spares)]
    audit = os.path.join(root, f"audit-{os.path.basename(job_dir)}.jsonl")
    job = elastic_step("train", "--model-def", model, "--data", data, "--job-dir", job_dir, "--workers", *group,
                       "--epochs", "400", "--minibatch-size", str(MINIBATCH), "--no-progress", "--max-relaunches", str(kills + 1),
                       "--audit", audit, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    watcher = AuditWatcher(audit)

    def recovered_after(moment: float):
        with open(os.path.join(job_dir, "events.jsonl")) as f:
            events = [json.loads(line) for line in f]
        return next((e["step_time"] for e in events if e["event"] == "recovered" and e["step_time"] > moment), None)

    results = []
    try:
        for _ in range(kills):
            s = wait_until(lambda: (st := job_status(job_dir)) and st["world_size"] == workers and st["samples_per_s"] > 0
                           and sum(bool(w.get("spare")) for w in st["workers"]) >= (spares or 0) and st,
                           120, "elastic-step did not reach full size (and its spares)")
            time.sleep(2.0)  # steady state
            victim = next(w for w in s["workers"] if w["rank"] == 1)
            killed_at = time.time()
            os.kill(victim["pid"], signal.SIGKILL)
            # The master records the first applied step after each regroup (rank 0's clock,
            # the same machine's as ours).
            results.append(wait_until(lambda: recovered_after(killed_at), 60, "no recovery") - killed_at)
            if outside is not None and spares is None:
                outside.append(wait_until(lambda: watcher.first_smaller_step(killed_at, workers * MINIBATCH), 60,
                                          "no smaller step in the audit") - killed_at)
            if splits is not None:
                splits.append(recovery_split(job_dir, killed_at))
    finally:
        watcher.close()
        job.send_signal(signal.SIGTERM)
        job.wait(30)
    return results


def read_pid(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# How torchrun is started. One node, as a user of one machine runs it: `--standalone` (a c10d
# rendezvous of exactly one node on a free local port), which re-forms at once after a restart.
ONE_NODE = ["--standalone"]
# An elastic multi-node job (`--nnodes 1:2`) run on one machine: after each restart its rendezvous
# waits up to its last-call timeout for a second node that never comes, so a restart costs tens of
# seconds. That is what torchrun's elastic range costs, not what recovery costs a one-node user;
# shown only with --torchrun multinode, beside this explanation, never as the headline.
MULTI_NODE = ["--nnodes", "1:2", "--rdzv-backend", "c10d"]


def torchrun_recovery(workers: int, data: str, root: str, kills: int, model: str = MODEL,
                      multinode: bool = False) -> list[float]:
    log, pids, ckpt = (os.path.join(root, n) for n in ("torchrun.jsonl", "pids", "ckpt"))
    for path in (pids, ckpt):
        os.makedirs(path, exist_ok=True)
        for stale in glob.glob(os.path.join(path, "*")):
            os.remove(stale)  # a run before this one (the other variant) leaves its pids and checkpoint
    if os.path.exists(log):
        os.remove(log)
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
    nodes = MULTI_NODE + ["--rdzv-endpoint", f"127.0.0.1:{free_port()}"] if multinode else ONE_NODE
    run = torchrun(*nodes, "--nproc-per-node", str(workers), "--max-restarts", str(kills + 1),
                   os.path.join(os.path.dirname(__file__), "ddp_peer.py"), "--model-def", model, "--data", data,
                   "--epochs", "400", "--minibatch-size", "32", "--step-log", log, "--checkpoint-dir", ckpt,
                   "--checkpoint-every", "50", "--pid-dir", pids, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = []
    try:
        for _ in range(kills):
            wait_until(lambda: os.path.exists(log) and len(read_steps(log)) > 200, 120, "torchrun did not start")
            time.sleep(2.0)
            pid = read_pid(os.path.join(pids, "rank1.pid"))
            killed_at = time.time()
            os.kill(pid, signal.SIGKILL)
            # torchrun restarts every worker; the restarted rank 1 writes a new pid file.
            wait_until(lambda: read_pid(os.path.join(pids, "rank1.pid")) not in (None, pid), 120, "torchrun did not restart")
            applied = wait_until(lambda: first_step_after(log, killed_at), 120, "torchrun did not recover")
            results.append(applied - killed_at)
    finally:
        run.send_signal(signal.SIGTERM)
        try:
            run.wait(30)
        except subprocess.TimeoutExpired:
            run.kill()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--model", choices=sorted(MODELS), default="small",
                        help="small: 17k parameters; wide: 8.6M (34 MB of weights, 69 MB of state with momentum)")
    parser.add_argument("--no-peer", action="store_true", help="elastic-step only")
    parser.add_argument("--keep", metavar="DIR", help="put the data and the jobs' folders (events, logs) here and keep them")
    parser.add_argument("--torchrun", choices=["one-node", "multinode"], default="one-node",
                        help="one-node: torchrun --standalone, as a user of one machine runs it (the peer quoted); "
                             "multinode: --nnodes 1:2, whose rendezvous waits for a second node after each restart "
                             "(see MULTI_NODE)")
    parser.add_argument("--spares", type=int, default=None, metavar="K",
                        help="a fixed group of --workers with K warm spares, beside the same fixed group without "
                             "spares (which waits for a relaunch), instead of the elastic group beside torchrun")
    args = parser.parse_args()
    print(f"recovery: SIGKILL 1 of {args.workers} workers, {args.model} digits MLP; {machine()}")
    splits: list[dict] = []
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    with (contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory()) as root:
        data = prepared_digits(root)
        if args.spares is not None:
            spared = elastic_recovery(args.workers, data, root, args.kills, MODELS[args.model], splits, spares=args.spares)
            bare = elastic_recovery(args.workers, data, root, args.kills, MODELS[args.model], spares=0)
            a, b = statistics.median(spared), statistics.median(bare)
            print(f"  --workers {args.workers} --spares {args.spares}: median {a:.3f}s  "
                  f"({', '.join(f'{x:.3f}' for x in spared)})   target <= 0.5 s")
            for split in splits:
                print("    " + ", ".join(f"{k} {v:.3f}s" if isinstance(v, float) else f"{k} {v}" for k, v in split.items()))
            print(f"  --workers {args.workers} (no spare, waits for the relaunch): median {b:.3f}s  "
                  f"({', '.join(f'{x:.3f}' for x in bare)})")
            return
        seen = []
        ours = elastic_recovery(args.workers, data, root, args.kills, MODELS[args.model], splits, outside=seen)
        theirs = [] if args.no_peer else torchrun_recovery(args.workers, data, root, args.kills, MODELS[args.model],
                                                           multinode=args.torchrun == "multinode")
    a = statistics.median(ours)
    print(f"  elastic-step: median {a:.3f}s  ({', '.join(f'{x:.3f}' for x in ours)}): the job's own figure "
          f"(rank 0's time of the smaller group's first step); load {os.getloadavg()[0]:.1f}")
    print(f"  seen from outside, the smaller group's first step appearing in the audit file: median "
          f"{statistics.median(seen):.3f}s  ({', '.join(f'{x:.3f}' for x in seen)})   target <= 0.5 s")
    for split in splits:
        print("    " + ", ".join(f"{k} {v:.3f}s" if isinstance(v, float) else f"{k} {v}" for k, v in split.items()))
    if not theirs:
        return
    b = statistics.median(theirs)
    print(f"  torchrun ({args.torchrun}): median {b:.3f}s  ({', '.join(f'{x:.3f}' for x in theirs)})")
    print(f"  ratio elastic-step / torchrun: {a / b:.3f}   (target <= {1 / 15:.3f})")


if __name__ == "__main__":
    main()
