"""`elastic-step status | scale | worker`: watch and steer a running job."""

from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("status", help="show a running job")
    p.add_argument("--job-dir", required=True)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=status)
    p = sub.add_parser("scale", help="change the number of workers of a running job")
    p.add_argument("--job-dir", required=True)
    p.add_argument("--workers", type=int, required=True)
    p.set_defaults(func=scale)
    p = sub.add_parser("worker", help="(started by the master) run one worker")
    p.set_defaults(func=worker)


def status(args) -> int:
    from elastic_step.jobclient import JobClient

    status = JobClient(args.job_dir).status()
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    print(f"job {status['job']}: {status['state']}  round {status['round']}  world size {status['world_size']}  "
          f"epoch {status['epoch'] + 1}/{status['epochs']}  rows {status['rows_done']}/{status['rows_total']}  "
          f"{status['samples_per_s']:.0f} samples/s" + (f"  spares {status['spares']}" if status.get("spares") else ""))
    for w in status["workers"]:
        rank = ("spare" if w.get("spare") else "-") if w["rank"] is None else w["rank"]
        print(f"  {w['id']:<8} {w['state']:<9} rank {rank:<3} step {w['step']:<6} pid {w.get('pid', '-'):<8} "
              f"rows {w['rows_applied']:<7} {w['exit']}")
    return 0


def scale(args) -> int:
    from elastic_step.jobclient import JobClient

    status = JobClient(args.job_dir).scale(args.workers)
    print(f"scaling job {status['job']} to {status['target_workers']} workers")
    return 0


def worker(args) -> int:
    from elastic_step.worker.leaving import leave_on_sigterm

    leave_on_sigterm()  # before the framework's imports, which take seconds: an eviction may come meanwhile
    from elastic_step.worker.loop import run_worker

    return run_worker()
