"""`elastic-step get | list | top | stop`: watch a job (its summary, its workers with what each
uses, its membership history) and stop it gracefully."""

from __future__ import annotations

import json
import os
import sys
import time


def register(sub) -> None:
    p = sub.add_parser("get", help="show a job: summary, workers (CPU, memory, GPU, relaunches) and, with -e, its events")
    p.add_argument("job", help="the job's folder (its --job-dir), or its name under --root")
    p.add_argument("--root", default=os.environ.get("ELASTIC_STEP_ROOT"), help="folder holding job folders (default: $ELASTIC_STEP_ROOT)")
    p.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table")
    p.add_argument("-e", "--events", action="store_true", help="also the membership events: deaths, relaunches, regroups, scaling, checkpoints")
    add_backend(p, "JOB is the job's name (--job-name); its master's published status, with your own credentials")
    p.add_argument("--mlflow-uri", default=os.environ.get("MLFLOW_TRACKING_URI"),
                   help="with --backend kubernetes: where to find a job that has ended (default: $MLFLOW_TRACKING_URI)")
    p.set_defaults(func=get)
    p = sub.add_parser("list", help="list jobs: state, age, workers, epoch, progress, samples/s")
    p.add_argument("--root", default=os.environ.get("ELASTIC_STEP_ROOT") or ".", help="folder holding job folders (default: $ELASTIC_STEP_ROOT, else .)")
    p.add_argument("--backend", choices=("local", "kubernetes"), default="local")
    p.add_argument("--namespace", help="with --backend kubernetes: the namespace (default: the current context's)")
    p.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table")
    p.set_defaults(func=list_jobs)
    p = sub.add_parser("top", help="the worker table of a job (or one line per job), refreshed in place")
    p.add_argument("job", nargs="?", help="the job's folder or name; without it, every job under --root")
    p.add_argument("--root", default=os.environ.get("ELASTIC_STEP_ROOT") or ".")
    p.add_argument("-r", "--refresh", type=float, default=2.0, metavar="SECONDS", help="seconds between refreshes (default 2)")
    p.add_argument("--iterations", type=int, default=0, help="stop after this many refreshes (default: until Ctrl-C)")
    add_backend(p, "JOB is the job's name; without it, every job of the namespace")
    p.set_defaults(func=top)
    p = sub.add_parser("stop", help="stop a job gracefully: a final checkpoint, workers stopped; `train --resume` continues it")
    p.add_argument("job", help="the job's folder or name")
    p.add_argument("--root", default=os.environ.get("ELASTIC_STEP_ROOT"))
    p.add_argument("--no-wait", dest="wait", action="store_false", help="return once the master took the request")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the job to stop (default 600)")
    add_backend(p, "JOB is the job's name; the request goes on its status ConfigMap, which its master reads")
    p.set_defaults(func=stop)
    p = sub.add_parser("ui", help="the live page of a job on Kubernetes, served on this machine's loopback from its published status")
    p.add_argument("job", help="the job's name (--job-name)")
    p.add_argument("--namespace", help="the job's namespace (default: the current context's)")
    p.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: any free one)")
    p.set_defaults(func=ui)


def add_backend(p, kubernetes_help: str) -> None:
    p.add_argument("--backend", choices=("local", "kubernetes"), default="local", help=f"kubernetes: {kubernetes_help}")
    p.add_argument("--namespace", help="with --backend kubernetes: the job's namespace (default: the current context's)")


def dump(data, output: str) -> None:
    if output == "json":
        print(json.dumps(data, indent=2, default=str))
    else:
        import yaml

        print(yaml.safe_dump(json.loads(json.dumps(data, default=str)), sort_keys=False), end="")


def get(args) -> int:
    from elastic_step.cli.render import print_job

    view = load_view(args, args.events)
    if args.output != "table":
        dump(view, args.output)
    else:
        print_job(view)
    return 0


def load_view(args, with_events: bool) -> dict:
    if args.backend == "kubernetes":
        from elastic_step.kubejobs import kubernetes_view

        return kubernetes_view(args.job, args.namespace, with_events, mlflow_uri=getattr(args, "mlflow_uri", None))
    from elastic_step.jobview import find_job, job_view

    return job_view(find_job(args.job, args.root), with_events=with_events)


def list_jobs(args) -> int:
    from elastic_step.cli.render import print_job_list

    if args.backend == "kubernetes":
        from elastic_step.kubejobs import list_kubernetes

        rows = list_kubernetes(args.namespace)
    else:
        from elastic_step.jobview import list_local

        rows = list_local(args.root)
    if args.output != "table":
        dump(rows, args.output)
    else:
        print_job_list(rows, kubernetes=args.backend == "kubernetes")
    return 0


def top(args) -> int:
    from rich.console import Console
    from rich.live import Live

    from elastic_step.cli.render import job_list_table, job_tables
    from elastic_step.errors import ElasticStepError
    from elastic_step.jobview import find_job, list_local

    kubernetes = args.backend == "kubernetes"
    if args.job and not kubernetes:
        args.job = find_job(args.job, args.root)  # an unknown job is an error at once, not a frame

    def frame():
        if not args.job:
            if kubernetes:
                from elastic_step.kubejobs import list_kubernetes

                return job_list_table(list_kubernetes(args.namespace), kubernetes=True)
            return job_list_table(list_local(args.root))
        try:
            return job_tables(load_view(args, with_events=False))
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
    from elastic_step.errors import ElasticStepError
    from elastic_step.jobclient import JobClient
    from elastic_step.jobview import find_job, load_job

    if args.backend == "kubernetes":
        from elastic_step.kubejobs import stop_kubernetes

        print(stop_kubernetes(args.job, args.namespace, args.timeout, wait=args.wait))
        return 0
    job_dir = find_job(args.job, args.root)
    job = load_job(job_dir, with_events=False)
    if not job["live"]:
        state = (job["result"] or {}).get("state") or job["status"].get("state")
        raise ElasticStepError(f"job {job['status'].get('job')} has ended ({state}); there is nothing to stop")
    client = JobClient(job_dir)
    try:
        status = client.stop()
    finally:
        client.close()
    print(f"stopping job {status['job']}: the workers checkpoint their next step, then stop", file=sys.stderr)
    if not args.wait:
        return 0
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        try:
            job = load_job(job_dir, with_events=False)
        except ElasticStepError:
            job = None  # between the master's end and its final status
        if job is not None and not job["live"]:
            result = job["result"] or {}
            state = result.get("state") or job["status"].get("state")
            if state == "stopped" and not result:
                time.sleep(0.5)  # the master still records the stop in MLflow; result.json follows
                continue
            if state != "stopped":
                raise ElasticStepError(f"job {status['job']} ended {state}, not stopped: {job['status'].get('failure', '')}")
            print(f"job {status['job']} stopped at its checkpoint of step {result.get('checkpoint_step')}; "
                  "`elastic-step train` with the same options and --resume continues it")
            return 0
        time.sleep(0.5)
    raise ElasticStepError(f"job {status['job']} did not stop within {args.timeout:.0f}s; see `elastic-step get {job_dir} -e`")


def ui(args) -> int:
    from elastic_step.errors import ElasticStepError
    from elastic_step.kubejobs import core_api, current_namespace, published_document, published_job, status_map, where_of
    from elastic_step.pageserver import PageServer, PublishedStatus

    api, namespace = core_api(), args.namespace or current_namespace()
    found = status_map(api, namespace, args.job)
    if found is None:
        raise ElasticStepError(f"no running job {args.job!r} in namespace {namespace}; see `elastic-step list --backend kubernetes`")

    def read() -> dict | None:
        current = status_map(api, namespace, args.job)
        return published_document(current, namespace) if current is not None else None

    job = published_job(found, namespace)
    server = PageServer(PublishedStatus(read), args.port)
    print(f"live page of job {job['info'].get('job', args.job)} ({where_of(job['info'])}): {server.url}", flush=True)
    print("Ctrl-C to stop", file=sys.stderr, flush=True)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
