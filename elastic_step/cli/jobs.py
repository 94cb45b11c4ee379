"""`elastic-step scale | delete | worker`: steer a running job's size, delete a submitted job with
everything it made, and the worker a master starts (hidden: people never run it themselves).
`status` is `get` (cli/observe.py)."""

from __future__ import annotations

import os


def register(sub) -> None:
    from elastic_step.cli.observe import add_job

    p = sub.add_parser("scale", help="change the number of workers of a running job, within its --workers MIN:MAX "
                                     "(or, with --ps, of a --mode ps job's parameter-server shards)")
    add_job(p, "scale")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--workers", type=int, metavar="N", help="the number of workers to run from now on")
    size.add_argument("--ps", type=int, metavar="N", help="the number of parameter-server shards to run from now on "
                      "(a --mode ps job): moves only the rows that change shard, no worker restarts")
    p.set_defaults(func=scale)
    p = sub.add_parser("delete", help="delete a submitted job and everything it made (pods, ConfigMaps, Secrets, "
                                      "NetworkPolicies with its label)")
    p.add_argument("job", metavar="JOB", help="the job's name (submit's --job-name)")
    p.add_argument("--backend", choices=("kubernetes",), default="kubernetes", help="jobs on Kubernetes only (`submit`'s)")
    p.add_argument("-n", "--namespace", default=os.environ.get("ELASTIC_STEP_NAMESPACE"),
                   help="the job's namespace (default: $ELASTIC_STEP_NAMESPACE, else your kubeconfig context's)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait until all is gone (default 60)")
    p.set_defaults(func=delete)
    p = sub.add_parser("worker", description="run one worker; started by the master with the job's settings in its "
                       "environment, never by hand")
    p.set_defaults(func=worker)
    # Out of `elastic-step --help`'s list: it is the master's to start.
    sub._choices_actions[:] = [action for action in sub._choices_actions if action.dest != "worker"]


def scale(args) -> int:
    from elastic_step.cli.observe import job_of, operator

    if args.ps is not None:
        from elastic_step.cli.scale_ps import scale_ps

        return scale_ps(args)

    print(operator(args).scale(job_of(args), args.workers))
    return 0


def delete(args) -> int:
    from elastic_step.operate.statusmap import core_api, current_namespace
    from elastic_step.submit.apply import delete_job

    namespace = args.namespace or current_namespace()
    deleted = delete_job(core_api().api_client, namespace, args.job, args.timeout)
    print(f"job {args.job} deleted from namespace {namespace}: {', '.join(deleted)}")
    return 0


def worker(args) -> int:
    from elastic_step.worker.leaving import leave_on_sigterm, run_until_leaving

    leave_on_sigterm()  # before the framework's imports, which take seconds: an eviction may come meanwhile
    from elastic_step.worker.loop import run_worker

    return run_until_leaving(run_worker)  # an eviction or a master gone leaves through here
