"""`elastic-step train`: run one elastic training job; this process is its master."""

from __future__ import annotations

from elastic_step import defaults
from elastic_step.cli.kubernetes_options import add_kubernetes_options
from elastic_step.cli.outputs import copy_folder, write_json, write_parameter
from elastic_step.config import TrainConfig
from elastic_step.protocol import DeviceChoice, LrScaling, Precision, TrainingMode


def register(sub) -> None:
    p = sub.add_parser("train", help="train a model with an elastic group of workers")
    p.add_argument("--model-def", required=True, help="model definition: a module name or a .py file")
    p.add_argument("--data", required=True, help="prepared data: manifest.json or its folder (a path, s3://, gs://, "
                   "or another fsspec URI; endpoint and credentials from AWS_* / GOOGLE_APPLICATION_CREDENTIALS)")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an fsspec storage option for --data's store, e.g. endpoint_url=http://minio:9000 or anon=true "
                        "(repeatable; workers get it too). Never a credential: those come from the environment")
    p.add_argument("--job-dir", required=True, help="folder for the job's state, logs and model")
    p.add_argument("--workers", default=defaults.WORKERS,
                   help="N, or MIN:MAX for an elastic group: start MAX, train while MIN are live (default %(default)s)")
    p.add_argument("--spares", type=int, default=defaults.SPARES, metavar="K",
                   help="K more workers that start, warm up and wait; when a member is lost one takes its rank in the "
                        "next round at once, so a fixed-size group recovers without waiting for a relaunch "
                        "(default %(default)s)")
    p.add_argument("--epochs", type=int, default=defaults.EPOCHS, help="default %(default)s")
    p.add_argument("--minibatch-size", type=int, default=defaults.MINIBATCH_SIZE, help="rows per worker (default %(default)s)")
    p.add_argument("--global-batch-size", type=int, default=defaults.GLOBAL_BATCH_SIZE, metavar="G",
                   help="rows in every optimizer step whatever the number of live workers: each worker computes "
                        "its share in minibatches of at most --minibatch-size and the step applies their sum, so a "
                        "run's results do not depend on failures (default %(default)s: off, each worker applies "
                        "--minibatch-size rows per step as with DDP)")
    p.add_argument("--lr-scaling", choices=[s.value for s in LrScaling], default=defaults.LR_SCALING,
                   help="without --global-batch-size, scale the model definition's learning rate by the rows a step "
                        "applies over a full group's (--minibatch-size x MAX): linear for SGD, sqrt for Adam; "
                        "the rate then follows the group as it shrinks and grows (default %(default)s)")
    p.add_argument("--device", choices=[d.value for d in DeviceChoice], default=defaults.DEVICE,
                   help="where each worker computes: auto takes a GPU the worker sees (a pod's requested GPU; local "
                        "workers one each by slot) and the CPU otherwise; cuda refuses to start without one "
                        "(default %(default)s)")
    p.add_argument("--precision", choices=[p.value for p in Precision], default=defaults.PRECISION,
                   help="the forward pass in fp32, or under bf16 or fp16 autocast (parameters and summed gradients stay "
                        "float32; fp16's loss scale computes an overflowed pass again rather than skip its rows; PyTorch "
                        "models only) (default %(default)s)")
    p.add_argument("--mode", choices=[m.value for m in TrainingMode], default=defaults.MODE,
                   help="allreduce: every worker holds the whole model; ps: the model's embedding tables (PsEmbedding) "
                        "live on --ps-shards parameter-server processes, dense weights by allreduce (default %(default)s)")
    # --ps as well, the flag `scale JOB --ps N` takes: without it argparse finds --ps ambiguous
    # (--ps-shards, --ps-cpu, --ps-memory) and refuses it.
    p.add_argument("--ps-shards", "--ps", dest="ps_shards", type=int, default=defaults.PS_SHARDS, metavar="N",
                   help="with --mode ps: shard processes (default %(default)s)")
    p.add_argument("--ps-table-limit-mb", type=float, default=defaults.PS_TABLE_LIMIT_MB, metavar="MB",
                   help="with --mode ps: tables (ids and weights) up to this size are held whole by the master and "
                        "logged with the model; larger ones are logged as the shards' snapshots with an MLflow pyfunc "
                        "model that serves from them (default %(default)s)")
    p.add_argument("--minibatches-per-task", type=int, default=defaults.MINIBATCHES_PER_TASK, help="default %(default)s")
    p.add_argument("--seed", type=int, default=defaults.SEED, help="default %(default)s")
    p.add_argument("--no-shuffle", dest="shuffle", action="store_false", help="keep task order fixed per epoch")
    p.add_argument("--audit", help="write every applied row range as JSON lines to this file")
    p.add_argument("--backend", choices=("local", "kubernetes"), default=defaults.BACKEND, help="where workers run: local processes or kubernetes pods "
                                                              "(default %(default)s)")
    p.add_argument("--port", type=int, default=defaults.PORT, help="master API port (default: a free one)")
    p.add_argument("--host", default=defaults.HOST, help="address the master listens on (default %(default)s)")
    p.add_argument("--max-relaunches", type=int, default=defaults.MAX_RELAUNCHES,
                   help="relaunches per worker slot (default %(default)s)")
    p.add_argument("--heartbeat-timeout", type=float, default=defaults.HEARTBEAT_TIMEOUT_S,
                   help="seconds of silence before a worker counts as hung (default %(default)s; a worker "
                        f"not yet in a round, still importing its framework, gets at least {defaults.WARM_UP_SILENCE_S:.0f})")
    p.add_argument("--rendezvous-timeout", type=float, default=defaults.RENDEZVOUS_TIMEOUT_S, help="default %(default)s")
    p.add_argument("--startup-grace", type=float, default=defaults.STARTUP_GRACE_S,
                   help="seconds to wait for all workers before starting with MIN (default %(default)s)")
    p.add_argument("--collective-timeout", type=float, default=defaults.COLLECTIVE_TIMEOUT_S, help="default %(default)s")
    p.add_argument("--master-timeout", type=float, default=defaults.MASTER_TIMEOUT_S,
                   help="workers exit when the master does not answer this long (at once, within seconds, when its "
                        "address refuses connections: it died; default %(default)s)")
    p.add_argument("--termination-grace", type=float, default=defaults.TERMINATION_GRACE_S, metavar="SECONDS",
                   help="the time between SIGTERM and SIGKILL this process gets (its pod's terminationGracePeriodSeconds; "
                        "every pod the project makes asks for the default): on SIGTERM the master checkpoints its next step "
                        "within the first half, saves everything to MLflow and exits 75, preempted (default %(default)s)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="show no progress: neither a terminal's progress bar nor the plain line every few seconds "
                        "elsewhere")
    t = p.add_argument_group("tracking (MLflow)")
    t.add_argument("--mlflow-uri", help="tracking URI (default: $MLFLOW_TRACKING_URI, else SQLite in the job dir)")
    t.add_argument("--experiment", default=defaults.EXPERIMENT, help="default %(default)s")
    t.add_argument("--parent-run-id", help="nest this job's run under a pipeline's parent run")
    t.add_argument("--checkpoint-steps", type=int, default=defaults.CHECKPOINT_STEPS,
                   help="checkpoint every K steps and at each epoch end (0: never; default %(default)s)")
    t.add_argument("--keep-checkpoints", type=int, default=defaults.KEEP_CHECKPOINTS, help="default %(default)s")
    t.add_argument("--keep-best", metavar="METRIC[:min|max]",
                   help="also keep the checkpoint with the best validation METRIC (e.g. accuracy, loss:min; without "
                        "a direction, names ending in loss or error are minimised); --init-from RUN_ID:best names it")
    t.add_argument("--resume", action="store_true",
                   help="continue this job's run from its newest committed checkpoint, and refuse to start when that run was "
                        "trained on other data, model or task size. Without it, an attempt that ended unfinished in this "
                        "--job-dir (preempted, stopped, failed, killed) is continued when its inputs match, and a pipeline's "
                        "retried step always continues its own run")
    t.add_argument("--init-from", help="warm start: models:/NAME@ALIAS, a model URI, a run id (its newest checkpoint), "
                                      "or RUN_ID:best (its best checkpoint, see --keep-best)")
    t.add_argument("--warm-start-alias", metavar="ALIAS",
                   help="with --registered-model: warm start from models:/NAME@ALIAS when it exists, else from scratch "
                        "(a scheduled retrain before the first champion)")
    t.add_argument("--registered-model", metavar="NAME", help="the registered model --warm-start-alias refers to")
    p.add_argument("--outputs", help="also write run_id, model_uri, metrics.json and model/ here (for Argo and other runners)")
    add_kubernetes_options(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from elastic_step.master.job import run_job

    config = train_config(args)
    if args.dry_run or config.backend == "kubernetes":
        from elastic_step.cli.kubernetes_options import dry_run_or_check

        if dry_run_or_check(config, args.dry_run):
            return 0
    result = run_job(config)
    if args.outputs:
        write_parameter(args.outputs, "run_id", result.run_id)
        write_parameter(args.outputs, "model_uri", result.model_uri)
        write_json(args.outputs, "metrics.json", result.test_metrics)
        copy_folder(args.outputs, "model", result.model_dir)
    metrics = "  ".join(f"{k} {v:.4f}" for k, v in result.test_metrics.items() if k != "rows")
    print(f"trained {result.steps} steps in {result.seconds:.1f}s; model in {result.model_dir}")
    print(f"mlflow: run {result.run_id} at {result.mlflow_uri}" + (f"; model {result.model_uri}" if result.model_uri else ""))
    print(f"test: {metrics}")
    print(f"rows audited: {result.rows_audited}" + (f"  recovery: {', '.join(f'{s:.2f}s' for s in result.recoveries_s)}" if result.recoveries_s else ""))
    return 0




def train_config(args) -> TrainConfig:
    """The job's settings from `train`'s flags: each flag is read here and nowhere else.

    Besides copying flags, three things happen on the way: `--storage-option`s are applied to
    `--data`'s store in this process (and handed to the workers in their environment, with the
    store's location; credentials they take from their own), and `--warm-start-alias` becomes
    `init_from` when the alias exists."""
    from elastic_step.data import stores
    from elastic_step.errors import ConfigError

    if args.storage_option:
        stores.set_storage_options(args.data, dict(stores.parse_storage_option(o) for o in args.storage_option))
    init_from = args.init_from
    if args.warm_start_alias and not init_from:
        from elastic_step.training_step import warm_start_source

        if not args.registered_model:
            raise ConfigError("--warm-start-alias needs --registered-model NAME (the model whose alias to start from)")
        init_from = warm_start_source(args.registered_model, args.warm_start_alias, args.mlflow_uri) or None
    return TrainConfig(
        model_def=args.model_def, data=args.data, job_dir=args.job_dir, workers=args.workers, spares=args.spares,
        epochs=args.epochs,
        minibatch_size=args.minibatch_size, minibatches_per_task=args.minibatches_per_task, seed=args.seed,
        global_batch_size=args.global_batch_size, lr_scaling=args.lr_scaling, device=args.device, precision=args.precision, mode=args.mode, ps_shards=args.ps_shards, ps_table_limit_mb=args.ps_table_limit_mb, shuffle=args.shuffle, audit=args.audit, backend=args.backend, host=args.host, port=args.port,
        max_relaunches=args.max_relaunches, heartbeat_timeout=args.heartbeat_timeout,
        rendezvous_timeout=args.rendezvous_timeout, startup_grace=args.startup_grace,
        collective_timeout=args.collective_timeout, master_timeout=args.master_timeout,
        termination_grace=args.termination_grace, progress=args.progress,
        mlflow_uri=args.mlflow_uri, experiment=args.experiment, parent_run_id=args.parent_run_id,
        checkpoint_steps=args.checkpoint_steps, keep_checkpoints=args.keep_checkpoints, keep_best=args.keep_best, resume=args.resume,
        init_from=init_from, worker_env=stores.worker_env(),
        # --backend kubernetes
        namespace=args.namespace, image=args.image, worker_cpu=args.worker_cpu, worker_memory=args.worker_memory,
        worker_gpus=args.worker_gpus, node_selector=args.node_selector, tolerations=args.tolerations,
        ps_cpu=getattr(args, "ps_cpu", None), ps_memory=getattr(args, "ps_memory", None),
        priority_class=args.priority_class, image_pull_secrets=args.image_pull_secrets,
        service_account=args.service_account, pending_timeout=args.pending_timeout,
        master_network_policy=args.master_network_policy, worker_store_secret=args.worker_store_secret,
    )
