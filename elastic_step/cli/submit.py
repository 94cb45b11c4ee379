"""`elastic-step submit`: a training job on a cluster from a laptop, with the caller's
kubeconfig, in the spirit of `elasticdl train` and `arena submit`. `submit` takes every `train`
option (the train command's own definitions, from its parser) and creates the job's master pod,
which runs `train --backend kubernetes` with them and creates the workers; `delete` (cli/jobs.py)
removes everything the job made."""

from __future__ import annotations

import argparse
import os

from elastic_step import defaults
from elastic_step.cli import train
from elastic_step.cli.aliases import add_alias
from elastic_step.errors import ConfigError

# `train` options that submit sets itself or that mean something else for a pod; every other
# `train` option goes to the master's command line as given.
NOT_FORWARDED = {"help", "job_dir", "backend", "dry_run", "model_def", "namespace", "mlflow_uri",
                 "worker_store_secret"}  # submit's --store-secret: the master gives its workers the same Secret
DEFAULT_MASTER_CPU, DEFAULT_MASTER_MEMORY = "1", "1Gi:4Gi"


def train_parser() -> argparse.ArgumentParser:
    """`train`'s parser as the train command registers it."""
    scratch = argparse.ArgumentParser(add_help=False)
    subparsers = scratch.add_subparsers()
    train.register(subparsers)
    return subparsers.choices["train"]


def register(sub) -> None:
    parent = train_parser()
    # (action, flag), taken before submit's own flags replace some of train's (which empties their option strings)
    forwarded = [(a, max(a.option_strings, key=len)) for a in parent._actions if a.dest not in NOT_FORWARDED]
    p = sub.add_parser("submit", parents=[parent], conflict_handler="resolve",
                       help="run a training job on a Kubernetes cluster: its master pod, which creates the workers")
    p.set_defaults(func=submit, forwarded=forwarded, worker_store_secret=None)  # train's flag, replaced by --store-secret
    p.add_argument("--job-dir", help=argparse.SUPPRESS)  # the master pod's own: /tmp/JOB
    p.add_argument("--backend", choices=("kubernetes",), default="kubernetes", help=argparse.SUPPRESS)
    s = p.add_argument_group("submit", "the job's master pod (with your kubeconfig's credentials)")
    s.add_argument("--job-name", required=True, help="the job's name: a DNS label (get/logs/stop/delete use it)")
    s.add_argument("--image", required=True, help="the image of the master and its workers (elastic-step's, or "
                                                  "one built FROM it with your model)")
    s.add_argument("--namespace", help="where the job runs; deploy/ must be applied there (default: the current "
                                       "context's)")
    s.add_argument("--model-def", required=True, help="a module in the image (e.g. elastic_step.model_zoo.digits_torch), "
                                                     "or a local .py file, shipped in a ConfigMap to the master and workers")
    s.add_argument("--volume", action="append", default=[], metavar="claim=NAME,mount_path=/data",
                   help="a PersistentVolumeClaim (or ElasticDL's host_path=/path,mount_path=/data) mounted in the master "
                        "and every worker, e.g. for --data /data/digits; add read_only=true (repeatable)")
    s.add_argument("--worker-gpus", "--worker-gpu", dest="worker_gpus", type=int, default=0,
                   help="nvidia.com/gpu per worker (default 0)")
    s.add_argument("--mlflow-uri", help="MLflow tracking URI (no password in it; default: --mlflow-secret's uri, else "
                                        "SQLite in the master pod, gone with it)")
    s.add_argument("--mlflow-secret", metavar="NAME",
                   help="Secret of an MLflow user: keys uri (unless --mlflow-uri is given), username, password "
                        f"(e.g. {defaults.MLFLOW_CREDENTIALS_SECRET}, as deploy/mlflow's docs make it)")
    s.add_argument("--store-secret", dest="store_secret", metavar="NAME",
                   help="Secret with the S3 store's AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (master and workers); "
                        "gs:// data takes none: the pods' service accounts reach GCS by workload identity")
    add_alias(s, "--worker-store-secret", "--store-secret", dest="store_secret")
    s.add_argument("--master-cpu", default=DEFAULT_MASTER_CPU, help="REQUEST[:LIMIT] (default %(default)s)")
    s.add_argument("--master-memory", default=DEFAULT_MASTER_MEMORY, help="REQUEST[:LIMIT] (default %(default)s)")
    s.add_argument("--dry-run", action="store_true", help="print everything it would create as YAML, create nothing")


def master_args(args, model_def: str, job_dir: str) -> list[str]:
    """The master's `train` command line: the options submit sets, then every forwarded `train`
    option whose value differs from its default (the image's own defaults apply to the rest)."""
    out = []
    for action, flag in args.forwarded:
        value = getattr(args, action.dest)
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            out += [flag] if value != action.default else []
        elif isinstance(action, argparse._AppendAction):
            for item in value or []:
                out += [flag, str(item)]
        elif value is not None and value != action.default:
            out += [flag, str(value)]
    return ["--backend", "kubernetes", "--job-dir", job_dir, "--model-def", model_def, *out]


def submission(args):
    """The job from submit's flags, with every local check done (no cluster needed)."""
    from elastic_step.backends.kubernetes.options import (WORKER_SERVICE_ACCOUNT, parse_node_selector, parse_toleration,
                                                          request_and_limit)
    from elastic_step.data.stores import parse_storage_option
    from elastic_step.errors import ConfigError
    from elastic_step.frameworks.device import check_gpu_request, parse_choice
    from elastic_step.operate.statusmap import current_namespace
    from elastic_step.submit import checks
    from elastic_step.submit.spec import SCRATCH, Submission, parse_volume

    checks.check_job_name(args.job_name)
    if args.job_dir:
        raise ConfigError(f"--job-dir: the job's folder is the master pod's own ({SCRATCH}/{args.job_name}); drop the flag")
    volumes = [parse_volume(text, i) for i, text in enumerate(args.volume)]
    checks.check_data(args.data, [v.mount_path for v in volumes])
    checks.check_store_secret(args.data, args.store_secret)
    checks.check_pod_path("--audit", args.audit)
    checks.check_pod_path("--outputs", args.outputs)
    checks.check_mlflow_uri(args.mlflow_uri)
    for option in args.storage_option:
        parse_storage_option(option)
    local_model = args.model_def.removeprefix("file://")
    model_file = local_model if os.path.isfile(local_model) else None
    if model_file:
        checks.check_model_file(model_file)
    request_and_limit("--worker-cpu", args.worker_cpu), request_and_limit("--worker-memory", args.worker_memory)
    request_and_limit("--ps-cpu", args.ps_cpu), request_and_limit("--ps-memory", args.ps_memory)
    check_gpu_request(args.worker_gpus, parse_choice(args.device), args.image, flag="--worker-gpu")
    sub = Submission(
        job=args.job_name, namespace=args.namespace or current_namespace(), image=args.image, train_args=[],
        model_file=model_file, volumes=volumes, mlflow_uri=args.mlflow_uri, mlflow_secret=args.mlflow_secret,
        store_secret=args.store_secret, priority_class=args.priority_class, image_pull_secrets=args.image_pull_secrets,
        node_selector=parse_node_selector(args.node_selector), tolerations=[parse_toleration(t) for t in args.tolerations],
        worker_service_account=args.service_account or WORKER_SERVICE_ACCOUNT,
        master_cpu=request_and_limit("--master-cpu", args.master_cpu),
        master_memory=request_and_limit("--master-memory", args.master_memory))
    sub.train_args = master_args(args, sub.model_path if model_file else args.model_def, sub.job_dir)
    check_train_options(args, sub.job_dir)
    return sub


def check_train_options(args, job_dir: str) -> None:
    """The job's settings checked here as the master will check them (train's own TrainConfig
    raises ConfigError), so a bad value is refused on the laptop rather than in the pod's log.
    The warm-start alias is the master's to look up: its MLflow may be reachable in the cluster
    only; the device is the worker pods' (check_gpu_request), not this machine's. A --mode ps job's
    shards are pods the master makes (backends/kubernetes/ps_pods.py)."""
    train.train_config(argparse.Namespace(**{**vars(args), "job_dir": job_dir, "warm_start_alias": None,
                                             "backend": "local", "device": "auto"}))


def submit(args) -> int:
    from elastic_step.submit import apply, checks
    from elastic_step.submit.spec import objects, to_yaml

    sub = submission(args)
    if args.dry_run:
        # The master then creates the worker pods, their token Secret, the status ConfigMap and the
        # NetworkPolicies (`train --backend kubernetes --dry-run` shows them).
        print(to_yaml(objects(sub)), end="")
        return 0
    api_client = _api_client()
    checks.check_cluster(api_client, sub)
    apply.create(api_client, sub)
    where = f"--namespace {sub.namespace}"
    print(f"job {sub.job} submitted: master pod {sub.namespace}/{sub.pod_name}"
          + (f", model definition in ConfigMap {sub.config_map_name}" if sub.model_file else ""))
    print("watch it with:")
    for command in ("get", "top", "logs", "stop"):
        print(f"  elastic-step {command} {sub.job} --backend kubernetes {where}"
              + ("  [--master | --worker ID] [-f]" if command == "logs" else ""))
    print(f"  elastic-step delete {sub.job} {where}")
    return 0


def _api_client():
    """The caller's own credentials: the kubeconfig (KUBECONFIG, ~/.kube/config), else in-cluster."""
    from elastic_step.operate.statusmap import core_api

    return core_api().api_client

