"""`elastic-step schedule kfp`: a recurring run of the compiled retraining pipeline on a KFP server."""

from __future__ import annotations

import json
import sys


def register(sub) -> None:
    p = sub.add_parser("schedule", help="schedule continuous retraining")
    targets = p.add_subparsers(dest="target", required=True)
    k = targets.add_parser("kfp", help="create a KFP recurring run of the retraining pipeline")
    k.add_argument("--host", required=True, help="KFP API endpoint, e.g. http://ml-pipeline-ui.kubeflow:80")
    k.add_argument("--cron", required=True,
                   help="five fields (minute hour day-of-month month day-of-week), converted to KFP's six "
                        "(seconds first); six fields are used as given")
    k.add_argument("--timezone", default="UTC",
                   help="the zone the cron expression is written in (default UTC); KFP evaluates cron in UTC, "
                        "so the hours are shifted to UTC")
    k.add_argument("--experiment", default="elastic-step-retraining", help="KFP experiment (created if missing)")
    k.add_argument("--name", default="elastic-step-retraining", help="name of the recurring run")
    k.add_argument("--package", help="compiled pipeline YAML (default: the installed retraining_pipeline.yaml)")
    k.add_argument("--params", default="{}", help="pipeline arguments as a JSON object")
    k.set_defaults(func=run_kfp)


def run_kfp(args) -> int:
    from elastic_step.errors import ConfigError
    from elastic_step.schedule import create_recurring_run, recurring_run_request

    try:
        params = json.loads(args.params)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--params is not JSON ({exc.msg}); give an object like '{{\"epochs\": 3}}'") from None
    if not isinstance(params, dict):
        raise ConfigError("--params must be a JSON object like '{\"epochs\": 3}'")
    request = recurring_run_request(args.cron, package=args.package, experiment=args.experiment,
                                    job_name=args.name, timezone=args.timezone, params=params)
    print(f"cron: {request.cron.note}")
    for warning in request.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    import kfp

    from elastic_step.errors import ElasticStepError

    try:
        client = kfp.Client(host=args.host)
        recurring = create_recurring_run(client, request)
    except Exception as exc:  # the kfp client raises many kinds (connection, API, auth)
        error = ElasticStepError(f"KFP at {args.host} refused or could not be reached: {exc}; check --host and that "
                                 "the KFP API server is up")
        error.exit_code = 1
        raise error from exc
    run_id = getattr(recurring, "recurring_run_id", None) or "?"
    print(f"recurring run {request.job_name} ({run_id}) on {args.host}: {request.cron.expression}, "
          "one at a time, no catch-up, caching off")
    return 0
