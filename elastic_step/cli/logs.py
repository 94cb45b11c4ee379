"""`elastic-step logs JOB`: the master's or a worker's log, filtered and followed."""

from __future__ import annotations

import os
import sys

from elastic_step.terminal import printable


def register(sub) -> None:
    p = sub.add_parser("logs", help="print a job's master or worker log (local files)")
    p.add_argument("job", help="the job's folder (its --job-dir), or its name under --root; on Kubernetes its name")
    p.add_argument("--root", default=os.environ.get("ELASTIC_STEP_ROOT"))
    p.add_argument("--backend", choices=("local", "kubernetes"), default="local",
                   help="kubernetes: a worker pod's log (pods/log, with your own credentials)")
    p.add_argument("--namespace", help="with --backend kubernetes (default: the current context's)")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--worker", "-i", metavar="ID", help="a worker: its id (w1.2) or its slot (w1: the newest attempt)")
    who.add_argument("--master", action="store_true", help="the master's log (the default)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the job ends (Ctrl-C stops)")
    p.add_argument("--tail", type=int, metavar="N", help="only the last N lines")
    p.add_argument("--since", metavar="DURATION", help="only lines of the last 30s, 5m, 2h, 1d")
    p.add_argument("--timestamps", action="store_true", help="start each line with its time (RFC 3339)")
    p.add_argument("-p", "--previous", action="store_true", help="the worker slot's attempt before the newest (a relaunched worker's earlier life)")
    p.set_defaults(func=logs)


def logs(args) -> int:
    from elastic_step.joblogs import follow, log_path, parse_since, read_log
    from elastic_step.jobview import find_job

    if args.backend == "kubernetes":
        return kubernetes_logs(args, parse_since(args.since) if args.since else None)
    job_dir = find_job(args.job, args.root)
    since = parse_since(args.since) if args.since else None
    path = log_path(job_dir, args.worker, args.master, args.previous)
    lines, offset = read_log(path, tail=args.tail, since_s=since, timestamps=args.timestamps)
    out = sys.stdout
    for line in lines:
        out.write(printable(line) + "\n")
    out.flush()
    if args.follow:

        def running() -> bool:
            return not any(os.path.exists(os.path.join(job_dir, name)) for name in ("status.json", "result.json"))

        try:
            for line in follow(path, offset, args.timestamps, running):
                out.write(printable(line) + "\n")
                out.flush()
        except KeyboardInterrupt:
            pass
    return 0


def kubernetes_logs(args, since_s: float | None, api=None) -> int:
    from elastic_step.errors import ElasticStepError
    from elastic_step.kubejobs import WORKER_CONTAINER, core_api, current_namespace, master_pod, pod_log, worker_pod

    api = api or core_api()
    namespace = args.namespace or current_namespace()
    if args.master:
        pod, container = master_pod(api, namespace, args.job)
        previous_container = args.previous
    else:
        pod, previous_container = worker_pod(api, namespace, args.job, args.worker, args.previous)
        container = WORKER_CONTAINER
    try:
        for line in pod_log(api, namespace, pod, previous=previous_container, tail=args.tail, since_s=since_s,
                            timestamps=args.timestamps, follow=args.follow, container=container):
            sys.stdout.write(printable(line) + "\n")
            sys.stdout.flush()
    except KeyboardInterrupt:
        pass
    return 0
