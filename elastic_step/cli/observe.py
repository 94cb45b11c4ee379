"""`elastic-step get | list | top | stop | ui`: watch a job (its summary, its workers with what
each uses, its membership history) and stop it gracefully, whatever backend runs it: every
command names the job the same way and asks elastic_step.operate, never the backend itself."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from elastic_step.operate import BACKENDS


def register(sub) -> None:
    p = sub.add_parser("get", aliases=["status"], help="show a job: summary, workers (CPU, memory, GPU, relaunches) and, "
                       "with -e, its events (`status` is the same command)")
    add_job(p, "show")
    p.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table", help="table for people (default), "
                   "or the whole view as JSON or YAML for scripts")
    p.add_argument("--json", dest="output", action="store_const", const="json", help=argparse.SUPPRESS)  # -o json, as `status` had it
    p.add_argument("-e", "--events", action="store_true", help="also the membership events: deaths, relaunches, regroups, "
                   "scaling, checkpoints")
    p.add_argument("--mlflow-uri", default=os.environ.get("MLFLOW_TRACKING_URI"),
                   help="on Kubernetes: where to find a job that has ended, its status gone with it (default: $MLFLOW_TRACKING_URI)")
    p.set_defaults(func=get)
    p = sub.add_parser("list", help="list jobs: state, age, workers, epoch, progress, samples/s")
    add_backend(p)
    p.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table", help="table (default), JSON or YAML")
    p.set_defaults(func=list_jobs)
    p = sub.add_parser("top", help="the worker table of a job (or one line per job), refreshed in place")
    add_job(p, "follow; without it, every job", optional=True)
    p.add_argument("-r", "--refresh", type=float, default=2.0, metavar="SECONDS", help="seconds between refreshes (default 2)")
    p.add_argument("--iterations", type=int, default=0, help="stop after this many refreshes (default: until Ctrl-C)")
    p.set_defaults(func=top)
    p = sub.add_parser("stop", help="stop a job gracefully: a final checkpoint, workers stopped; `train --resume` continues it")
    add_job(p, "stop")
    p.add_argument("--no-wait", dest="wait", action="store_false", help="return once the master took the request")
    p.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS", help="seconds to wait for the job to stop (default 600)")
    p.set_defaults(func=stop)
    p = sub.add_parser("ui", help="the live page of a job: its master's address, or on Kubernetes the page served on this "
                       "machine's loopback from its published status")
    add_job(p, "show")
    p.add_argument("--port", type=int, default=0, help="on Kubernetes: the port on 127.0.0.1 to serve it on (default: any free one)")
    p.set_defaults(func=ui)


def add_backend(p) -> None:
    """--backend, -n/--namespace and --root, with their defaults from the environment."""
    p.add_argument("--backend", choices=BACKENDS, default=os.environ.get("ELASTIC_STEP_BACKEND") or None,
                   help="where the job runs: local (job folders on this machine) or kubernetes (read with your own "
                        "credentials); default: $ELASTIC_STEP_BACKEND, else local where JOB is a job folder here (or "
                        "no JOB is named), else kubernetes where you have a kubeconfig")
    p.add_argument("-n", "--namespace", default=os.environ.get("ELASTIC_STEP_NAMESPACE"),
                   help="on Kubernetes: the jobs' namespace (default: $ELASTIC_STEP_NAMESPACE, else your kubeconfig "
                        "context's)")
    p.add_argument("--root", default=os.environ.get("ELASTIC_STEP_ROOT"),
                   help="local: the folder holding job folders, where a JOB given by name is looked for, and what "
                        "`list` lists (default: $ELASTIC_STEP_ROOT, else .)")


def add_job(p, what: str, optional: bool = False) -> None:
    """The positional JOB every command takes, then --backend and where to look."""
    p.add_argument("job", metavar="JOB", nargs="?", help=f"the job to {what}: locally its folder (--job-dir) or its name "
                   "under --root; on Kubernetes its name, as `list` shows it, or its instance")
    p.add_argument("--job-dir", dest="job_dir", help=argparse.SUPPRESS)  # what `status` and `scale` took before JOB
    add_backend(p)
    p.set_defaults(job_optional=optional)


def backend_of(args) -> str:
    """--backend, else the backend of the job named (elastic_step.operate decides)."""
    from elastic_step.operate import backend_for

    return args.backend or backend_for(getattr(args, "job", None) or getattr(args, "job_dir", None), args.root)


def job_of(args) -> str | None:
    """JOB, or the --job-dir it replaces; a command that needs one and got none is refused."""
    job = args.job or args.job_dir
    if job is None and not args.job_optional:
        from elastic_step.errors import ConfigError

        raise ConfigError(f"name the job: `elastic-step {args.command} JOB` (its folder, or its name as `elastic-step list` "
                          "shows it)")
    return job


def operator(args):
    from elastic_step.operate import operator_for

    args.backend = backend_of(args)
    return operator_for(args.backend, root=args.root, namespace=args.namespace, mlflow_uri=getattr(args, "mlflow_uri", None))


def dump(data, output: str) -> None:
    if output == "json":
        print(json.dumps(data, indent=2, default=str))
    else:
        import yaml

        print(yaml.safe_dump(json.loads(json.dumps(data, default=str)), sort_keys=False), end="")


def get(args) -> int:
    from elastic_step.cli.render import print_job

    view = operator(args).view(job_of(args), args.events)
    if args.output != "table":
        dump(view, args.output)
    else:
        print_job(view)
    return 0


def list_jobs(args) -> int:
    from elastic_step.cli.render import print_job_list

    rows = operator(args).jobs()
    if args.output != "table":
        dump(rows, args.output)
    else:
        print_job_list(rows)
    return 0


def top(args) -> int:
    from rich.console import Console
    from rich.live import Live

    from elastic_step.cli.render import job_list_table, job_tables
    from elastic_step.errors import ElasticStepError

    jobs = operator(args)
    job = job_of(args)
    if job:
        job = jobs.locate(job)  # an unknown or ambiguous job is an error at once, not a frame

    def frame():
        if not job:
            return job_list_table(jobs.jobs())
        try:
            return job_tables(jobs.view(job))
        except ElasticStepError as exc:  # the job ended or its master went away meanwhile: say so, keep going
            from rich.text import Text

            return Text(str(exc))

    console = Console(width=None if sys.stdout.isatty() else 200)  # a pipe gets whole lines, not 80 columns
    count = 0
    try:
        with Live(frame(), console=console, auto_refresh=False, transient=False) as live:
            while True:
                count += 1
                if args.iterations and count >= args.iterations:
                    break
                time.sleep(max(args.refresh, 0.1))
                live.update(frame(), refresh=True)
    except KeyboardInterrupt:
        pass
    return 0


def stop(args) -> int:
    print(operator(args).stop(job_of(args), args.timeout, args.wait, say=lambda text: print(text, file=sys.stderr)))
    return 0


def ui(args) -> int:
    from elastic_step.operate.pageserver import PageServer, PublishedStatus

    page = operator(args).live_page(job_of(args))
    if page.url:  # the master serves it itself
        print(f"live page of {page.describe}: {page.url}", flush=True)
        return 0
    server = PageServer(PublishedStatus(page.read), args.port)
    print(f"live page of {page.describe}: {server.url}", flush=True)
    print("Ctrl-C to stop", file=sys.stderr, flush=True)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
