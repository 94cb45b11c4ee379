"""`elastic-step evaluate | export | promote`: the release steps for runners other than KFP (Argo,
a shell). Same engine functions as the KFP components; outputs as files under --outputs."""

from __future__ import annotations

from elastic_step.cli.outputs import write_json, write_parameter, write_text
from elastic_step.errors import ConfigError


def _common(p, outputs_help: str) -> None:
    p.add_argument("--mlflow-uri", help="tracking URI (default: $MLFLOW_TRACKING_URI, else --job-dir's store)")
    p.add_argument("--job-dir", metavar="JOB",
                   help="a local job's folder: without --mlflow-uri and $MLFLOW_TRACKING_URI, use the MLflow store "
                        "train made in it (its mlflow.db, train's default)")
    p.add_argument("--outputs", help=outputs_help)


def _tracking_uri(args) -> str | None:
    """The store to use: --mlflow-uri, else $MLFLOW_TRACKING_URI (MLflow reads it itself), else
    the job folder's own store, so a shell's release steps find what a local train recorded."""
    import os

    if args.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI") or not args.job_dir:
        return args.mlflow_uri
    from elastic_step.tracking.run import default_tracking_uri

    if not os.path.isfile(os.path.join(args.job_dir, "mlflow.db")):
        raise ConfigError(f"--job-dir {args.job_dir!r} holds no MLflow store (mlflow.db): the job recorded to a "
                          "tracking server; give its URI with --mlflow-uri")
    return default_tracking_uri(args.job_dir)


def _candidate(p) -> None:
    p.add_argument("--run-id", required=True, help="the training run (the train step's run_id output)")
    p.add_argument("--model-uri", default="", help="the trained model (default: the run's logged model)")
    p.add_argument("--data", required=True, help="prepared data: manifest.json or its folder (its test split is used)")
    p.add_argument("--registered-model", required=True, help="name of the model in the MLflow registry")
    p.add_argument("--model-def", required=True, metavar="MODULE|FILE.py",
                   help="the model definition the run was trained with (the pipeline's model-def parameter): the "
                        "run's weights are loaded into its network. Required: the run's own model_def parameter is "
                        "not used, since anyone who can write to MLflow can change it")


def _model_def(args) -> str:
    if not args.model_def.strip():
        raise ConfigError("--model-def is empty; give the module or .py file the run was trained with "
                          "(e.g. elastic_step.model_zoo.digits_torch)")
    return args.model_def


def register(sub) -> None:
    p = sub.add_parser("evaluate", help="judge a trained model against floors and the current @champion")
    _candidate(p)
    p.add_argument("--floor", action="append", default=[], metavar="METRIC=VALUE",
                   help="the candidate must reach this (repeatable; e.g. accuracy=0.9)")
    p.add_argument("--min-gain", action="append", default=[], metavar="METRIC=VALUE",
                   help="... and beat the champion by at least this much (0: strictly better)")
    _common(p, "write blessed, reason, metrics.json and report.md here")
    p.set_defaults(func=evaluate)

    p = sub.add_parser("export", help="log the model in its serving format and register a new version")
    _candidate(p)
    p.add_argument("--checkpoint", choices=["final", "best"], default="final",
                   help="which weights of the run: final (the finished job's model, default) or best (the best "
                        "validated checkpoint the run kept with train --keep-best)")
    _common(p, "write model_version and registered_model_uri here")
    p.set_defaults(func=export)

    p = sub.add_parser("promote", help="move @champion to a version (the old one keeps @previous-champion)")
    p.add_argument("--registered-model", required=True, help="name of the model in the MLflow registry")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--version", help="the version to promote (export's model_version output)")
    which.add_argument("--rollback", action="store_true", help="swap @champion and @previous-champion back")
    _common(p, "write champion_version here")
    p.set_defaults(func=promote)


def evaluate(args) -> int:
    from elastic_step.release.gate import evaluate_candidate

    result = evaluate_candidate(run_id=args.run_id, model_uri=args.model_uri, data=args.data,
                                registered_model=args.registered_model, floors=args.floor, min_gains=args.min_gain,
                                mlflow_uri=_tracking_uri(args), model_def=_model_def(args))
    if args.outputs:
        write_parameter(args.outputs, "blessed", result.blessed)
        write_parameter(args.outputs, "reason", result.reason)
        write_json(args.outputs, "metrics.json", result.candidate_metrics)
        write_text(args.outputs, "report.md", result.report)
    print(result.reason)
    return 0


def export(args) -> int:
    from elastic_step.release.export import export_model

    result = export_model(run_id=args.run_id, model_uri=args.model_uri, data=args.data,
                          registered_model=args.registered_model, mlflow_uri=_tracking_uri(args), model_def=_model_def(args),
                          checkpoint=args.checkpoint)
    if args.outputs:
        write_parameter(args.outputs, "model_version", result.version)
        write_parameter(args.outputs, "registered_model_uri", result.registered_model_uri)
    print(f"{'found' if result.reused else 'registered'} {result.registered_model_uri} ({result.serving_model_uri})")
    return 0


def promote(args) -> int:
    from elastic_step.release.promote import promote as promote_version, rollback

    mlflow_uri = _tracking_uri(args)
    if args.rollback:
        result = rollback(args.registered_model, mlflow_uri=mlflow_uri)
    else:
        result = promote_version(args.registered_model, args.version, mlflow_uri=mlflow_uri)
    if args.outputs:
        write_parameter(args.outputs, "champion_version", result.champion)
    print(result.describe())
    return 0
