"""`elastic-step`: prepare data, train elastically, watch and scale a job."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from elastic_step.errors import ElasticStepError


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a model with an elastic group of workers")
    p.add_argument("--model-def", required=True, help="model definition: a module name or a .py file")
    p.add_argument("--data", required=True, help="prepared data: manifest.json or its folder")
    p.add_argument("--job-dir", required=True, help="folder for the job's state, logs and model")
    p.add_argument("--workers", default="2", help="N, or MIN:MAX for an elastic group (default 2)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--minibatch-size", type=int, default=32)
    p.add_argument("--minibatches-per-task", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-shuffle", dest="shuffle", action="store_false", help="keep task order fixed per epoch")
    p.add_argument("--audit", help="write every applied row range as JSON lines to this file")
    p.add_argument("--backend", default="local", help="where workers run (default: local processes)")
    p.add_argument("--port", type=int, default=0, help="master API port (default: a free one)")
    p.add_argument("--host", default="127.0.0.1", help="address the master listens on")
    p.add_argument("--max-relaunches", type=int, default=3, help="relaunches per worker slot (default 3)")
    p.add_argument("--heartbeat-timeout", type=float, default=10.0, help="seconds of silence before a worker counts as hung")
    p.add_argument("--rendezvous-timeout", type=float, default=60.0)
    p.add_argument("--startup-grace", type=float, default=60.0, help="seconds to wait for all workers before starting with MIN")
    p.add_argument("--collective-timeout", type=float, default=30.0)
    p.add_argument("--master-timeout", type=float, default=30.0, help="workers exit when the master is unreachable this long")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    t = p.add_argument_group("tracking (MLflow)")
    t.add_argument("--mlflow-uri", help="tracking URI (default: $MLFLOW_TRACKING_URI, else SQLite in the job dir)")
    t.add_argument("--experiment", default="elastic-step")
    t.add_argument("--parent-run-id", help="nest this job's run under a pipeline's parent run")
    t.add_argument("--checkpoint-steps", type=int, default=100, help="checkpoint every K steps and at each epoch end (0: never)")
    t.add_argument("--keep-checkpoints", type=int, default=3)
    t.add_argument("--resume", action="store_true", help="continue this job's run from its newest committed checkpoint")
    t.add_argument("--init-from", help="warm start: models:/NAME@ALIAS, a model URI, or a run id (its newest checkpoint)")


def _add_prepare(sub) -> None:
    p = sub.add_parser("prepare-data", help="turn a dataset into a manifest and Parquet shards")
    p.add_argument("--source", required=True, help="sklearn:digits, or a CSV/Parquet/JSONL URI (file:, s3://, gs://, path)")
    p.add_argument("--out", required=True, help="output folder (or fsspec URI)")
    p.add_argument("--label", default="label")
    p.add_argument("--features", help="comma-separated feature columns (default: every other column)")
    p.add_argument("--split", default="0.8,0.1,0.1", help="TRAIN,VAL,TEST fractions")
    p.add_argument("--rows-per-shard", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)


def _cmd_prepare(args) -> int:
    from elastic_step.data.prepare import prepare_data
    from elastic_step.errors import ConfigError

    try:
        split = tuple(float(x) for x in args.split.split(","))
    except ValueError:
        raise ConfigError(f"--split {args.split!r} is not three comma-separated fractions like 0.8,0.1,0.1") from None
    features = [f for f in args.features.split(",") if f] if args.features else None
    manifest = prepare_data(args.source, args.out, label=args.label, features=features, split=split,
                            rows_per_shard=args.rows_per_shard, seed=args.seed)
    counts = ", ".join(f"{name} {manifest.rows(name)}" for name in manifest.splits)
    print(f"prepared {args.source} -> {args.out}: {counts} rows; {len(manifest.features)} features; hash {manifest.content_hash[:12]}")
    return 0


def _cmd_train(args) -> int:
    from elastic_step.config import TrainConfig
    from elastic_step.master.job import run_job

    options = {k: v for k, v in vars(args).items() if k not in ("command", "func", "verbose")}
    config = TrainConfig(**options)
    result = run_job(config)
    metrics = "  ".join(f"{k} {v:.4f}" for k, v in result.test_metrics.items() if k != "rows")
    print(f"trained {result.steps} steps in {result.seconds:.1f}s; model in {result.model_dir}")
    print(f"mlflow: run {result.run_id} at {result.mlflow_uri}" + (f"; model {result.model_uri}" if result.model_uri else ""))
    print(f"test: {metrics}")
    print(f"rows audited: {result.rows_audited}" + (f"  recovery: {', '.join(f'{s:.2f}s' for s in result.recoveries_s)}" if result.recoveries_s else ""))
    return 0


def _cmd_status(args) -> int:
    from elastic_step.jobclient import JobClient

    status = JobClient(args.job_dir).status()
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    print(f"job {status['job']}: {status['state']}  round {status['round']}  world size {status['world_size']}  "
          f"epoch {status['epoch'] + 1}/{status['epochs']}  rows {status['rows_done']}/{status['rows_total']}  "
          f"{status['samples_per_s']:.0f} samples/s")
    for w in status["workers"]:
        rank = "-" if w["rank"] is None else w["rank"]
        print(f"  {w['id']:<8} {w['state']:<9} rank {rank:<3} step {w['step']:<6} pid {w.get('pid', '-'):<8} "
              f"rows {w['rows_applied']:<7} {w['exit']}")
    return 0


def _cmd_scale(args) -> int:
    from elastic_step.jobclient import JobClient

    status = JobClient(args.job_dir).scale(args.workers)
    print(f"scaling job {status['job']} to {status['target_workers']} workers")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elastic-step", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the master does")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_prepare(sub)
    _add_train(sub)
    p = sub.add_parser("status", help="show a running job")
    p.add_argument("--job-dir", required=True)
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("scale", help="change the number of workers of a running job")
    p.add_argument("--job-dir", required=True)
    p.add_argument("--workers", type=int, required=True)
    sub.add_parser("worker", help="(started by the master) run one worker")
    return parser


COMMANDS = {"prepare-data": _cmd_prepare, "train": _cmd_train, "status": _cmd_status, "scale": _cmd_scale}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "worker":
        from elastic_step.worker.loop import run_worker

        return run_worker()
    try:
        return COMMANDS[args.command](args)
    except ElasticStepError as exc:
        print(f"elastic-step {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
