"""`elastic-step logs JOB`: the master's or a worker's log, filtered and followed, whatever
backend runs the job (its log files locally, its pods' logs on Kubernetes)."""

from __future__ import annotations

import sys

from elastic_step.terminal import printable


def register(sub) -> None:
    from elastic_step.cli.observe import add_job

    p = sub.add_parser("logs", help="print a job's master or worker log")
    add_job(p, "read")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--worker", "-i", metavar="ID", help="a worker: its id (w1.2) or its slot (w1: the newest attempt)")
    who.add_argument("--master", action="store_true", help="the master's log (the default)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the job ends (Ctrl-C stops)")
    p.add_argument("--tail", type=int, metavar="N", help="only the last N lines")
    p.add_argument("--since", metavar="DURATION", help="only lines of the last 30s, 5m, 2h, 1d")
    p.add_argument("--timestamps", action="store_true", help="start each line with its time (RFC 3339)")
    p.add_argument("-p", "--previous", action="store_true", help="the worker slot's attempt before the newest (a relaunched "
                   "worker's earlier life); on Kubernetes with --master, the master container's earlier run")
    p.set_defaults(func=logs)


def logs(args) -> int:
    from elastic_step.cli.observe import job_of, operator
    from elastic_step.operate.logfiles import parse_since
    from elastic_step.operate import LogRequest

    request = LogRequest(worker=args.worker, previous=args.previous, tail=args.tail, timestamps=args.timestamps,
                         since_s=parse_since(args.since) if args.since else None, follow=args.follow)
    lines = operator(args).log_lines(job_of(args), request)
    try:
        for line in lines:
            sys.stdout.write(printable(line) + "\n")
            sys.stdout.flush()
    except KeyboardInterrupt:
        pass
    return 0
