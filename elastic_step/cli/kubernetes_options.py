"""The `train` command's options for `--backend kubernetes`, in their own argument group."""

from __future__ import annotations

from elastic_step import defaults
from elastic_step.cli.aliases import add_alias


def add_kubernetes_options(parser) -> None:
    k = parser.add_argument_group("kubernetes backend", "worker pods, when --backend kubernetes")
    k.add_argument("--namespace", help="namespace for worker pods (default: the master pod's, else the kubeconfig's)")
    k.add_argument("--image", help="worker image (default: ELASTIC_STEP_IMAGE, else the image of the master pod's `main` "
                                   "container, else elastic-step's image of this version outside a pod)")
    k.add_argument("--worker-cpu", help="CPU per worker: REQUEST or REQUEST:LIMIT (e.g. 2, or 500m:2)")
    k.add_argument("--worker-memory", help="memory per worker: REQUEST or REQUEST:LIMIT (e.g. 4Gi, or 2Gi:4Gi)")
    k.add_argument("--worker-gpus", type=int, default=0, help="nvidia.com/gpu per worker (default 0)")
    k.add_argument("--ps-cpu", help="with --mode ps: CPU per parameter-server pod, REQUEST or REQUEST:LIMIT (default: a worker's)")
    k.add_argument("--ps-memory", help="with --mode ps: memory per parameter-server pod, REQUEST or REQUEST:LIMIT, e.g. "
                                       "8Gi:8Gi for the tables of its shard (default: a worker's)")
    k.add_argument("--node-selector", action="append", default=[], metavar="KEY=VALUE", help="repeatable")
    k.add_argument("--toleration", dest="tolerations", action="append", default=[], metavar="KEY[=VALUE][:EFFECT]",
                   help="repeatable, e.g. nvidia.com/gpu:NoSchedule")
    k.add_argument("--priority-class", help="PriorityClass of worker pods (the master's is its own pod's: "
                                            "argo render --priority-class, submit --priority-class)")
    k.add_argument("--image-pull-secret", dest="image_pull_secrets", action="append", default=[], metavar="NAME",
                   help="repeatable")
    k.add_argument("--service-account", help="service account of worker pods, never the master's (default "
                                             "elastic-step-worker from deploy/rbac: no Role; no token is mounted)")
    k.add_argument("--pending-timeout", type=float, default=defaults.PENDING_TIMEOUT_S,
                   help="seconds a pod may stay unschedulable or unable to pull its image before the job fails it "
                        "(default %(default)s)")
    k.add_argument("--store-secret", dest="worker_store_secret", metavar="NAME",
                   help="Secret (keys AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) worker pods read the data store with: "
                        "read-only keys for the dataset (docs/kubernetes.md). Default: ELASTIC_STEP_WORKER_STORE_SECRET, "
                        "else the Secrets the master's own keys come from, except KFP's mlpipeline-minio-artifact "
                        "(every pipeline's artifacts, read and write), for which workers take elastic-step-data-reader")
    add_alias(k, "--worker-store-secret", "--store-secret", dest="worker_store_secret")
    k.add_argument("--no-master-network-policy", dest="master_network_policy", action="store_false",
                   help="start even where the master pod's own NetworkPolicy (only its workers reach its API and "
                        "its unauthenticated rendezvous store) cannot be made: outside a pod, workers in another "
                        "namespace, a master pod that cannot be read or has no labels. Only for a cluster that "
                        "enforces no NetworkPolicies or a master isolated otherwise; without it such a job is refused")
    k.add_argument("--dry-run", action="store_true",
                   help="print the worker pod and Secret manifests as YAML and exit without training")


def dry_run_or_check(config, dry_run: bool) -> bool:
    """`--dry-run`: print the manifests and say so (True: nothing more to do). Otherwise make
    sure worker pods will be able to reach this master before anything starts."""
    from elastic_step.errors import ConfigError

    if config.backend != "kubernetes":
        raise ConfigError(f"--dry-run shows the pods of --backend kubernetes; this job uses --backend {config.backend}")
    from elastic_step.backends.kubernetes.manifests import dry_run_manifests
    from elastic_step.backends.kubernetes.options import check_master_reachable, master_pod_from_env, settings_from_config
    from elastic_step.images import default_image

    if not dry_run:
        check_master_reachable(config)
        return False
    settings = settings_from_config(config)
    print(dry_run_manifests(config, settings, master_pod_from_env(), settings.image or default_image()), end="")
    return True
