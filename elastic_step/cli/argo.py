"""`elastic-step argo render`: native Argo Workflows YAML (WorkflowTemplate, Workflow, CronWorkflow)."""

from __future__ import annotations

from elastic_step import defaults
from elastic_step.cli.aliases import add_alias


def register(sub) -> None:
    p = sub.add_parser("argo", help="Argo Workflows YAML for the pipelines")
    actions = p.add_subparsers(dest="action", required=True)
    r = actions.add_parser("render", help="write the WorkflowTemplate, Workflow (and CronWorkflow) of a pipeline")
    r.add_argument("--pipeline", required=True, choices=["training", "retraining", "all"],
                   help="which pipeline's YAML: training, retraining (with a CronWorkflow that runs it on --cron), "
                        "or all")
    r.add_argument("--out", required=True, help="folder to write the YAML files into")
    r.add_argument("--pvc", help="pass files between steps on this PersistentVolumeClaim instead of the "
                                 "cluster's artifact repository")
    r.add_argument("--data-store", metavar="URI",
                   help="keep the prepared dataset in this object store (s3://bucket/prefix, gs://...; one folder per "
                        "workflow) instead of passing it as an artifact: needed with backend=kubernetes, whose worker "
                        "pods read it themselves; the steps need the store's endpoint and credentials in their env")
    r.add_argument("--store-secret", metavar="NAME",
                   help="Secret with keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY for the data store, given to "
                        "every step (and by reference to the train step's worker pods)")
    r.add_argument("--store-endpoint", metavar="URL", help="AWS_ENDPOINT_URL of an S3-compatible data store (MinIO)")
    r.add_argument("--mlflow-secret", metavar="NAME",
                   help="Secret with keys uri, username and password of an MLflow user (deploy/mlflow's server needs "
                        "one; default name elastic-step expects: %s), given to every step as MLFLOW_TRACKING_URI, "
                        "_USERNAME and _PASSWORD: the URI is fixed with the password, so there is no mlflow-uri "
                        "workflow parameter and whoever submits a run cannot send the password elsewhere. Without it: "
                        "the mlflow-uri workflow parameter, no user" % defaults.MLFLOW_CREDENTIALS_SECRET)
    add_alias(r, "--mlflow-credentials", "--mlflow-secret", dest="mlflow_secret")
    r.add_argument("--image", help="container image of every step and of the worker pods (default: ELASTIC_STEP_IMAGE, "
                                   "else the project image)")
    r.add_argument("--image-registry", metavar="REGISTRY",
                   help="instead of --image: REGISTRY/elastic-step-torch:VERSION, the name `make push "
                        "IMAGE_REGISTRY=REGISTRY` pushes (e.g. registry.example.com/team)")
    r.add_argument("--image-version", metavar="VERSION",
                   help="with --image-registry: the image's tag (default: this package's version)")
    r.add_argument("--train-retries", type=int, default=3, help="retries of the train step (default 3)")
    r.add_argument("--cron", default="0 3 * * *", help="CronWorkflow schedule, five fields (default '0 3 * * *')")
    r.add_argument("--timezone", default="UTC", help="CronWorkflow time zone (IANA name, default UTC)")
    r.add_argument("--starting-deadline", type=int, default=3600,
                   help="seconds after a missed schedule within which the run still starts (default 3600)")
    r.add_argument("--history-limit", type=int, default=3, help="finished runs kept per outcome (default 3)")
    r.add_argument("--service-account", default="elastic-step-runner",
                   help="service account of the step pods; the train step creates worker pods with it (default "
                        "elastic-step-runner, from deploy/rbac)")
    r.add_argument("--deploy-service-account", default="elastic-step-deployer",
                   help="service account of the deploy step's pod alone: it creates the model server's "
                        "Deployments and Service or InferenceService (default elastic-step-deployer, from "
                        "deploy/serving)")
    r.add_argument("--train-cpu", default="4", help="CPU request of the train step (the master), a quantity (default 4)")
    r.add_argument("--train-memory", default="8Gi", help="memory request and limit of the train step (default 8Gi)")
    r.add_argument("--train-gpus", type=int, default=0, help="nvidia.com/gpu of the train step (default 0)")
    r.add_argument("--step-cpu", default="1", help="CPU request of every other step (default 1)")
    r.add_argument("--step-memory", default="2Gi", help="memory request and limit of every other step (default 2Gi)")
    r.add_argument("--worker-cpu", metavar="REQUEST[:LIMIT]",
                   help="CPU of each worker pod the train step creates, fixed in the template (e.g. 2 or 500m:2; "
                        "default: none)")
    r.add_argument("--worker-memory", metavar="REQUEST[:LIMIT]",
                   help="memory of each worker pod, fixed in the template (e.g. 4Gi or 2Gi:4Gi; default: none, so "
                        "no limit)")
    r.add_argument("--ps-cpu", metavar="REQUEST[:LIMIT]",
                   help="CPU of each parameter-server shard pod of a run with mode ps, fixed in the template "
                        "(default: a worker pod's)")
    r.add_argument("--ps-memory", metavar="REQUEST[:LIMIT]",
                   help="memory of each parameter-server shard pod of a run with mode ps, fixed in the template "
                        "(e.g. 8Gi; default: a worker pod's)")
    r.add_argument("--worker-gpus", type=int, default=0, metavar="N",
                   help="nvidia.com/gpu of each worker pod, fixed in the template (default 0); the workers then "
                        "compute on their GPU (the device workflow parameter, default auto)")
    r.add_argument("--worker-node-selector", action="append", default=[], metavar="KEY=VALUE",
                   help="a node label each worker pod must match, fixed in the template (repeatable; e.g. "
                        "cloud.google.com/gke-accelerator=nvidia-l4)")
    r.add_argument("--worker-toleration", action="append", default=[], metavar="KEY[=VALUE][:EFFECT]",
                   help="a taint each worker pod tolerates, fixed in the template (repeatable; e.g. "
                        "nvidia.com/gpu:NoSchedule)")
    r.add_argument("--worker-service-account", metavar="NAME",
                   help="service account of the worker pods (default: elastic-step-worker from deploy/workers: no "
                        "Role, no token mounted); never the step pods' --service-account")
    r.add_argument("--priority-class", metavar="NAME",
                   help="PriorityClass of every pod the workflow makes: its step pods (the train step's is the "
                        "master) and the train step's worker pods; fixed in the template (default: none, the "
                        "cluster's default priority)")
    r.set_defaults(func=run_render)


def run_render(args) -> int:
    from elastic_step.argo import PIPELINES, RenderOptions, render
    from elastic_step.errors import ConfigError
    from elastic_step.images import ImageNameError, chosen_image

    extra = {}
    if args.image or args.image_registry or args.image_version:
        try:
            extra["image"] = chosen_image(args.image, args.image_registry, args.image_version)
        except ImageNameError as exc:
            raise ConfigError(f"--image-registry/--image-version: {exc}") from None
    uri_secret, credentials = mlflow_secrets(args.mlflow_secret)
    options = RenderOptions(pvc=args.pvc, data_store=args.data_store, store_secret=args.store_secret,
                            store_endpoint=args.store_endpoint, mlflow_secret=uri_secret, mlflow_credentials=credentials,
                            train_retries=args.train_retries,
                            cron=args.cron, timezone=args.timezone, starting_deadline_seconds=args.starting_deadline,
                            history_limit=args.history_limit, service_account=args.service_account,
                            deploy_service_account=args.deploy_service_account,
                            train_cpu=args.train_cpu, train_memory=args.train_memory, train_gpus=args.train_gpus,
                            step_cpu=args.step_cpu, step_memory=args.step_memory,
                            worker_cpu=args.worker_cpu, worker_memory=args.worker_memory, worker_gpus=args.worker_gpus,
                            ps_cpu=args.ps_cpu, ps_memory=args.ps_memory,
                            worker_node_selector=tuple(args.worker_node_selector),
                            worker_tolerations=tuple(args.worker_toleration),
                            worker_service_account=args.worker_service_account,
                            priority_class=args.priority_class, **extra)
    pipelines = list(PIPELINES) if args.pipeline == "all" else [args.pipeline]
    for path in render(pipelines, args.out, options):
        print(f"wrote {path}")
    return 0


def mlflow_secrets(value: str | None) -> tuple[str | None, str | None]:
    """(Secret of the URI alone, Secret of uri/username/password) from --mlflow-secret. NAME:KEY is
    the flag's old meaning, a Secret holding only the tracking URI under KEY: still rendered as it
    was, with a line saying it is deprecated."""
    import sys

    if value and ":" in value:
        print(f"elastic-step argo render: --mlflow-secret NAME:KEY (a Secret holding only the tracking URI) is "
              f"deprecated, use --mlflow-secret NAME of a Secret with keys uri, username, password", file=sys.stderr)
        return value, None
    return None, value
