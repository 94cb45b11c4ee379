"""The master as a pod of the cluster stand-in (tests/cluster: an HTTPS API server enforcing
deploy/'s Role, a kubelet running each pod's containers in their own filesystem view), its
worker pods created through the API, the data in a private bucket of an S3 server. Figures:

- job start (the step pod created) to the first applied step, and to the first applied step
  with 3 worker pods;
- SIGKILL of one worker pod's container (`docker kill`) to the next applied step, with
  `--workers 2:3` (target <= 0.5 s);
- a paused worker pod (`docker pause`) to the next applied step (target: the heartbeat
  timeout + <= 0.5 s).

The step times are the master's (rank 0 reports each step's time; events.jsonl records the
first step after each regroup), read through the master pod's scratch volume on the node."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from common import MODEL, machine, prepared_digits, wait_until  # noqa: E402

SCRATCH = "/tmp"
JOB_DIR = "/tmp/job"
SECRET = "bench-data-store"
HEARTBEAT_TIMEOUT = 4.0


def master_pod(cluster, name: str, args: list[str]):
    from kubernetes import client as k8s

    downward = lambda path: k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(field_path=path))  # noqa: E731
    secret = lambda key: k8s.V1EnvVarSource(secret_key_ref=k8s.V1SecretKeySelector(name=SECRET, key=key))  # noqa: E731
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(name=name, labels={"app.kubernetes.io/name": "train-step"}),
        spec=k8s.V1PodSpec(
            service_account_name=cluster.service_account, restart_policy="Never",
            security_context=k8s.V1PodSecurityContext(run_as_user=1000, run_as_group=1000, fs_group=1000),
            containers=[k8s.V1Container(
                name="main", image=cluster.project_image, command=["elastic-step", "train", *args],
                env=[k8s.V1EnvVar(name=f"ELASTIC_STEP_POD_{n}", value_from=downward(f))
                     for n, f in (("NAME", "metadata.name"), ("UID", "metadata.uid"), ("NAMESPACE", "metadata.namespace"),
                                  ("IP", "status.podIP"))]
                + [k8s.V1EnvVar(name="MLFLOW_TRACKING_URI", value=f"sqlite:///{SCRATCH}/mlflow.db"),
                   k8s.V1EnvVar(name="AWS_ACCESS_KEY_ID", value_from=secret("access-key")),
                   k8s.V1EnvVar(name="AWS_SECRET_ACCESS_KEY", value_from=secret("secret-key"))],
                volume_mounts=[k8s.V1VolumeMount(name="scratch", mount_path=SCRATCH)],
            )],
            volumes=[k8s.V1Volume(name="scratch", empty_dir=k8s.V1EmptyDirVolumeSource())],
        ),
    )


def committed_code(root: str) -> tuple[str, str]:
    """The engine as committed (HEAD), for the pods' image: every pod of the job, however late it
    starts, runs the same code even while the working tree changes. (folder, commit)"""
    repo = os.path.dirname(HERE)
    out = os.path.join(root, "code")
    os.makedirs(out)
    archive = subprocess.run(["git", "-C", repo, "archive", "HEAD", "elastic_step"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", out], input=archive, check=True)
    commit = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return out, commit


def run(root: str, kills: int, pauses: int, docker: bool) -> dict:
    from contextlib import nullcontext

    from kubernetes import client as k8s

    from cluster import Cluster, Image, venv_image
    from cluster.runtime import DockerDaemon, ImageState
    from elastic_step.images import default_image
    from stores import S3Server

    data = prepared_digits(root, copies=10)
    daemon = None
    if docker:  # the image `make image-smoke` built, in its daemon's data root
        daemon = DockerDaemon(os.environ.get("IMAGE_SMOKE_DIR") or os.path.join(os.path.dirname(HERE), "build", "image-smoke")).start()
        state = daemon.image_state(default_image())
        if state is not ImageState.CURRENT:  # missing, or built from older sources: it would time older code
            daemon.stop()
            sys.exit(f"--docker: the image {default_image()} in the image-smoke daemon's data root is {state.value}; "
                     "run `make image-smoke` first")
        image, commit = Image(default_image(), {}, docker=default_image()), "the built image"
    else:
        code, commit = committed_code(root)
        image = venv_image(default_image(), extra_path=[code])
    figures: dict = {"kill_s": [], "pause_s": [], "commit": commit}
    with (daemon or nullcontext()), S3Server() as s3, \
            Cluster(os.path.join(root, "cluster"), images={default_image(): image}, docker=daemon) as cluster:
        figures["runtime"] = cluster.kubelet.mode
        uri = s3.upload(data, "bench-data", "digits")
        ns, api = cluster.namespace, cluster.core()
        api.create_namespaced_secret(ns, k8s.V1Secret(metadata=k8s.V1ObjectMeta(name=SECRET),
                                                      string_data={"access-key": "AKIDBENCH", "secret-key": "not-a-real-secret"}))
        args = ["--backend", "kubernetes", "--data", uri, "--storage-option", f"endpoint_url={s3.endpoint}",
                "--model-def", MODEL, "--job-dir", JOB_DIR, "--workers", "2:3", "--epochs", "400", "--minibatch-size", "32",
                "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), "--checkpoint-steps", "0", "--worker-cpu", "500m",
                "--max-relaunches", str(kills + pauses + 1), "--no-progress"]
        name = "train-step-bench"
        created = time.time()
        api.create_namespaced_pod(ns, master_pod(cluster, name, args))

        def node_path(path: str) -> str:
            return os.path.join(cluster.kubelet.volume_path(ns, name, "scratch"), os.path.relpath(path, SCRATCH))

        def lines(file: str) -> list[dict]:
            try:
                with open(node_path(f"{JOB_DIR}/{file}")) as f:
                    return [json.loads(line) for line in f if line.endswith("\n")]
            except (OSError, KeyError):
                return []

        def steps() -> list[dict]:
            return lines("metrics.jsonl")

        def full(after: float):
            return next((s for s in steps() if s["time"] > after and s["world_size"] == 3), None)

        def recovered_after(moment: float):
            return next((e["step_time"] for e in lines("events.jsonl") if e["event"] == "recovered" and e["step_time"] > moment), None)

        def live_worker_pods() -> list[dict]:
            pods = [p for p in cluster.pods(selector="app.kubernetes.io/component=worker")
                    if (p.get("status") or {}).get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]
            return sorted(pods, key=lambda p: p["metadata"]["name"])

        first = wait_until(lambda: (s := steps()) and s[0], 300, "no applied step")
        figures["first_step_s"] = first["time"] - created
        figures["first_full_step_s"] = wait_until(lambda: full(created), 300, "never 3 workers")["time"] - created
        since = created
        for action, count in (("kill", kills), ("pause", pauses)):
            for _ in range(count):
                # A step on 3 pods after the last recovery: the replacement has joined the round.
                wait_until(lambda: full(since), 300, "the replacement pod never joined")
                time.sleep(2.0)  # steady state
                victim = live_worker_pods()[0]["metadata"]["name"]
                at = time.time()
                if action == "kill":
                    cluster.kubelet.kill(ns, victim)
                else:
                    cluster.kubelet.pause(ns, victim)
                done = time.time()  # the kill/pause call returned (docker kill/pause: the daemon's own latency)
                since = wait_until(lambda: recovered_after(at), 120, f"no step after the {action}")
                figures[f"{action}_s"].append(since - at)
                figures.setdefault(f"{action}_call_s", []).append(done - at)
        api.delete_namespaced_pod(name, ns, grace_period_seconds=5)
        wait_until(lambda: not cluster.pods(), 60, "pods left")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--pauses", type=int, default=2)
    parser.add_argument("--docker", action="store_true",
                        help="pods as Docker containers of the image `make image-smoke` built (else the process runtime)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as root:
        f = run(root, args.kills, args.pauses, args.docker)
    print(f"cluster stand-in ({machine()}; kubelet runtime: {f['runtime']}; engine at {f['commit']}; digits x10 in S3, "
          "--workers 2:3)")
    print(f"  job start -> first applied step:             {f['first_step_s']:.2f} s")
    print(f"  job start -> first applied step on 3 pods:   {f['first_full_step_s']:.2f} s")
    print(f"  SIGKILL of a worker pod -> next step:        median {statistics.median(f['kill_s']):.3f} s "
          f"({', '.join(f'{x:.3f}' for x in f['kill_s'])})  target <= 0.5 s")
    calls = [x - c for x, c in zip(f["kill_s"], f["kill_call_s"])]
    print(f"    of which the kill call itself:             median {statistics.median(f['kill_call_s']):.3f} s; "
          f"from its return to the next step: median {statistics.median(calls):.3f} s")
    if f["pause_s"]:
        over = [x - HEARTBEAT_TIMEOUT for x in f["pause_s"]]
        print(f"  paused worker pod -> next step:              median {statistics.median(f['pause_s']):.3f} s "
              f"= heartbeat timeout {HEARTBEAT_TIMEOUT:g} s + {statistics.median(over):.3f} s "
              f"({', '.join(f'{x:.3f}' for x in f['pause_s'])})  target: + <= 0.5 s")


if __name__ == "__main__":
    main()
