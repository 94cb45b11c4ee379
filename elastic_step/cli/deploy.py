"""`elastic-step deploy`: a registered version on a cluster (KServe or MLflow's model server), with
canary and rollback; the endpoint and the served version as outputs under --outputs."""

from __future__ import annotations

import os
import sys

from elastic_step.cli.outputs import write_parameter


def register(sub) -> None:
    p = sub.add_parser("deploy", help="serve a registered version on a cluster: KServe InferenceService or MLflow's server")
    p.add_argument("--registered-model", required=True, help="name of the model in the MLflow registry")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--alias", help="the alias to deploy (e.g. champion), resolved to its version once")
    which.add_argument("--version", help="the version to deploy (export_model's model_version)")
    which.add_argument("--rollback", action="store_true", help="return to the revision the last deploy replaced")
    p.add_argument("--target", default="mlflow", help="kserve (an InferenceService) or mlflow (a Deployment and Service "
                                                      "of MLflow's model server; default)")
    p.add_argument("--namespace", required=True, help="the namespace the server runs in")
    p.add_argument("--name", default="", help="InferenceService / Service name (default: from the model's name)")
    p.add_argument("--service-account", required=True, help="the server pods' service account (KServe reads the "
                                                            "store's credentials through its Secrets)")
    p.add_argument("--storage-secret", required=True, help="the Secret holding the model store's credentials")
    p.add_argument("--canary-percent", type=int, default=10, help="traffic for a new version while a previous one "
                                                                  "serves, until it is Ready (default 10)")
    p.add_argument("--replicas", type=int, default=1, help="server pods of the served version (default 1)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for Ready before rolling back")
    p.add_argument("--image", default="", help="the mlflow target's server image (default: elastic-step's own)")
    p.add_argument("--serving-mlflow-uri", default="", help="the registry as the server pods reach it "
                                                            "(default: --mlflow-uri without credentials)")
    p.add_argument("--mlflow-uri", help="tracking URI of the registry (default: $MLFLOW_TRACKING_URI)")
    p.add_argument("--dry-run", action="store_true", help="print the objects a first deploy writes; touch no cluster")
    p.add_argument("--outputs", help="write endpoint and served_version here")
    p.set_defaults(func=deploy)


def settings_from_args(args):
    from elastic_step.images import default_image
    from elastic_step.release.deploy_render import DeploySettings, object_name

    return DeploySettings(namespace=args.namespace, name=args.name or object_name(args.registered_model),
                          service_account=args.service_account, storage_secret=args.storage_secret,
                          mlflow_uri=args.serving_mlflow_uri or without_credentials(args.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI", "")),
                          image=args.image or default_image(), replicas=args.replicas, canary_percent=args.canary_percent)


def without_credentials(uri: str) -> str:
    """The URI a pod may hold in its spec: credentials reach it from the Secret instead."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(uri)
    return urlunsplit(parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else ""))) if parts.hostname else uri


def deploy(args) -> int:
    import yaml

    from elastic_step.release.deploy import deploy_model

    result = deploy_model(registered_model=args.registered_model, settings=settings_from_args(args), alias=args.alias or "",
                          version=args.version or "", target=args.target, timeout=args.timeout, rollback=args.rollback,
                          dry_run=args.dry_run, mlflow_uri=args.mlflow_uri)
    if args.dry_run:
        print(yaml.safe_dump_all(result.objects, sort_keys=False), end="")
    if args.outputs:
        write_parameter(args.outputs, "endpoint", result.endpoint)
        write_parameter(args.outputs, "served_version", result.version)
    print(result.describe(), file=sys.stderr if args.dry_run else sys.stdout, flush=True)  # stdout: the YAML
    return 0
