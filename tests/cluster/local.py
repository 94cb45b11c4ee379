"""`make cluster`: the tests' cluster stand-in, up for trying by hand — the HTTPS API server, the
scheduler and the kubelet (the process runtime, or with `--docker` the Docker runtime on the
image `make image-smoke` builds), an S3 server (moto, with an empty bucket training-data) and an
MLflow server with basic auth, all on 127.0.0.1. It is a stand-in for trying and for tests, not a cluster: one node, no Services or
DNS, pods on the machine's own network, or with `--pod-network` (namespaces runtime, or with
`--docker` too each pod's sandbox container) each pod on an address of its own with
NetworkPolicies enforced, S3 and MLflow reached through the gateway.

It writes, in its folder (`build/cluster` by default):
- `admin.kubeconfig` (mode 600): kubectl and `elastic-step --backend kubernetes` as the admin;
- `env` (mode 600): the S3 endpoint and keys, the MLflow URI and a user of it, KUBECONFIG, and
  for `submit`: ELASTIC_STEP_IMAGE, POD_S3_ENDPOINT and POD_MLFLOW_URI (S3 and MLflow as pods reach them);
and, in the job namespace, the Secrets `elastic-step-data-reader` (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY) and `mlflow-credentials` (username, password) that `elastic-step submit
--store-secret/--mlflow-secret` name. It runs until Ctrl-C or `make cluster-stop` (SIGTERM to the
pid in `cluster.pid`), then stops every server and pod it started.

    PYTHONPATH=tests python -m cluster.local [--root build/cluster] [--docker] [--pod-network]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import threading

from kubernetes import client as k8s

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if TESTS not in sys.path:  # stores.py and mlflow_server.py, beside this package
    sys.path.insert(0, TESTS)

from cluster import Cluster, Image  # noqa: E402
from cluster.rbac import REPO  # noqa: E402
from mlflow_server import MlflowServer  # noqa: E402
from stores import S3Server  # noqa: E402

BUCKET = "training-data"  # made empty at start, for prepare-data's --out and submit's --data
# The store's keys for jobs, under the name deploy/rbac's admission policy lets worker pods read
# (its storeSecrets), as docs/kubernetes.md makes it for a real store.
STORE_SECRET = "elastic-step-data-reader"


def write_private(path: str, text: str) -> None:
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(text)


def docker_runtime():
    """The test's own Docker daemon on image-smoke's data root, which must hold the image."""
    from elastic_step.images import default_image

    from cluster.runtime import DaemonBusy, DockerDaemon, ImageState

    work = os.environ.get("IMAGE_SMOKE_DIR") or os.path.join(REPO, "build", "image-smoke")
    try:
        daemon = DockerDaemon(work).start()
    except DaemonBusy as exc:
        print(f"cluster: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    state = daemon.image_state(default_image())
    if state is not ImageState.CURRENT:
        daemon.stop()
        why = "not there" if state is ImageState.MISSING else "the one there was built from other sources than this checkout's"
        print(f"cluster: --docker needs the image {default_image()} in {work} ({why}): run `make image-smoke` first",
              file=sys.stderr)
        raise SystemExit(2)
    return daemon, {default_image(): Image(default_image(), {}, docker=default_image())}


def secrets_for_jobs(cluster: Cluster, s3: S3Server, mlflow: MlflowServer, user: str, password: str) -> dict[str, str]:
    """The Secrets a job names, in the job namespace; returns what a user's shell sets."""
    api, ns = cluster.core(), cluster.namespace
    store = s3.env()
    api.create_namespaced_secret(ns, k8s.V1Secret(metadata=k8s.V1ObjectMeta(name=STORE_SECRET), string_data={
        "AWS_ACCESS_KEY_ID": store["AWS_ACCESS_KEY_ID"], "AWS_SECRET_ACCESS_KEY": store["AWS_SECRET_ACCESS_KEY"]}))
    api.create_namespaced_secret(ns, k8s.V1Secret(metadata=k8s.V1ObjectMeta(name="mlflow-credentials"),
                                                  string_data={"username": user, "password": password}))
    return {**store, **mlflow.credentials_env(user, password), "ELASTIC_STEP_IMAGE": cluster.project_image,
            "POD_S3_ENDPOINT": cluster.pod_url(s3.endpoint), "POD_MLFLOW_URI": cluster.pod_url(mlflow.uri)}


def usage(root: str, kubeconfig: str, cluster: Cluster, s3: S3Server, mlflow: MlflowServer) -> str:
    return f"""
Local cluster stand-in up (one node, runtime: {cluster.kubelet.mode}).
  API server   {cluster.server.url}   namespace {cluster.namespace}
  S3           {s3.endpoint} (bucket {BUCKET})   MLflow {mlflow.uri} (basic auth)
Use it:
  export KUBECONFIG={kubeconfig}
  set -a; . {os.path.join(root, 'env')}; set +a     # S3 and MLflow for your shell
  kubectl apply -k deploy/
  kubectl get nodes,pods -o wide
  elastic-step submit --job-name try --image {cluster.project_image} --model-def elastic_step.model_zoo.digits_torch \\
      --data s3://{BUCKET}/PATH --storage-option endpoint_url={cluster.pod_url(s3.endpoint)} --store-secret {STORE_SECRET} \\
      --mlflow-uri {cluster.pod_url(mlflow.uri)} --mlflow-secret mlflow-credentials
Stop it: Ctrl-C here, or `make cluster-stop`.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=os.path.join(REPO, "build", "cluster"), help="its folder (made afresh)")
    parser.add_argument("--docker", action="store_true", help="the Docker runtime on `make image-smoke`'s image")
    parser.add_argument("--pod-network", action="store_true",
                        help="each pod on an address of its own, NetworkPolicies enforced (with --docker: each pod's "
                             "sandbox container on it; else the namespaces runtime)")
    args = parser.parse_args(argv)
    root = os.path.abspath(args.root)
    pid_file = os.path.join(root, "cluster.pid")
    if os.path.exists(pid_file):
        print(f"cluster: one already runs from {root} (pid file {pid_file}): `make cluster-stop` first", file=sys.stderr)
        return 2
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(os.path.join(root, "mlflow"))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    daemon, images = docker_runtime() if args.docker else (None, None)
    s3, mlflow = S3Server().start(), MlflowServer(os.path.join(root, "mlflow"), auth=True)
    s3.client().create_bucket(Bucket=BUCKET)
    try:
        mlflow.start(timeout=240)  # a loaded machine takes its time over the first start
        password = mlflow.create_user("elastic-step")
        for kind in ("experiment", "registered_model"):
            mlflow.grant("elastic-step", kind, "*", "MANAGE")
        with Cluster(os.path.join(root, "cluster"), images=images, docker=daemon,
                     pod_network=args.pod_network) as cluster:
            kubeconfig = cluster.kubeconfig(root, "admin", cluster.admin_token)
            env = secrets_for_jobs(cluster, s3, mlflow, "elastic-step", password)
            write_private(os.path.join(root, "env"), "".join(f"{k}={v}\n" for k, v in {**env, "KUBECONFIG": kubeconfig}.items()))
            write_private(pid_file, f"{os.getpid()}\n")
            print(usage(root, kubeconfig, cluster, s3, mlflow), flush=True)
            while not stop.wait(1.0):  # until Ctrl-C or `make cluster-stop`
                pass
            print("cluster: stopping", flush=True)
    finally:
        mlflow.stop()
        s3.stop()
        if daemon is not None:
            daemon.stop()
        if os.path.exists(pid_file):
            os.remove(pid_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
