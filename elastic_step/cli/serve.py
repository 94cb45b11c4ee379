"""`elastic-step serve | deploy`: a registered model behind MLflow's model server, on this machine
or on a cluster (KServe InferenceService or a plain Deployment), resolved through the registry."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a registered model on 127.0.0.1 with MLflow's model server")
    p.add_argument("model", metavar="models:/NAME@ALIAS", help="the model: models:/NAME@ALIAS or models:/NAME/VERSION")
    p.add_argument("--port", type=int, default=5000, help="port on 127.0.0.1 (default 5000; 0: any free port)")
    p.add_argument("--mlflow-uri", help="tracking URI of the registry (default: $MLFLOW_TRACKING_URI)")
    p.add_argument("--ready-timeout", type=float, default=120.0, help="seconds to wait for /ping (default 120)")
    p.set_defaults(func=serve)

    from elastic_step.cli import deploy

    deploy.register(sub)


def serve(args) -> int:
    import signal

    from elastic_step.release.serve import serve_forever, start

    signal.signal(signal.SIGTERM, _interrupt)  # a stop while the server starts stops it too
    try:
        server = start(args.model, port=args.port, mlflow_uri=args.mlflow_uri, ready_timeout=args.ready_timeout)
    except KeyboardInterrupt:
        return 0
    print(f"serving {server.model.model_uri} (run {server.model.run_id}) at {server.url}: "
          f"POST {server.url}/invocations, GET {server.url}/ping", flush=True)
    return serve_forever(server)


def _interrupt(signum, frame):
    raise KeyboardInterrupt
