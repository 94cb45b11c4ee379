"""What stands in for the cluster at the deploy's seam (elastic_step.release.deploy_apply's
ServingCluster) for the rollout tests: Deployments and Services kept as the rendered dicts, and
each Deployment's one pod a real local process of its rendered container (command with $(VAR)
expanded from its env as Kubernetes does, env values and the template's MLflow address), Ready
when its readiness probe's GET answers 200, as the kubelet judges it. A server that never answers
stays not Ready (Kubernetes would restart it in a loop; Ready it never is).

Every pod has an address of its own, as a pod IP is: 127.0.0.1 and a free port given to its
server in place of the rendered `-p` (`address(deployment)`). Not modelled: the API server and
RBAC (tests/test_deploy_cluster.py covers the checks made through the real client), more than one
replica, and the Service's load balancing (a test asks each track's pod)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from elastic_step.errors import JobFailed
from elastic_step.release.deploy_render import PREVIOUS_VERSION_ANNOTATION, VERSION_LABEL, Track
from mlflow_server import free_port

POD_IP = "127.0.0.1"


class FakeServingCluster:
    def __init__(self, namespace: str, folder: str):
        self.namespace = namespace
        self.folder = folder
        self.objects: dict[tuple[str, str], dict] = {}  # (kind, name) -> the object as written
        self.pods: dict[str, subprocess.Popen] = {}  # Deployment name -> its pod's process
        self.addresses: dict[str, str] = {}  # Deployment name -> its pod's http://IP:PORT
        self.calls: list[tuple[str, str]] = []

    def served_version(self, name: str):
        stable = self.objects.get(("Deployment", f"{name}-{Track.STABLE.value}"))
        if stable is None:
            return None
        meta = stable["metadata"]
        return meta["labels"].get(VERSION_LABEL, ""), meta.get("annotations", {}).get(PREVIOUS_VERSION_ANNOTATION, "")

    def write(self, obj: dict) -> None:
        key = (obj["kind"], obj["metadata"]["name"])
        self.calls.append(("write", f"{key[0]}/{key[1]}"))
        changed = self.objects.get(key, {}).get("spec") != obj["spec"]
        self.objects[key] = obj
        if obj["kind"] == "Deployment" and changed:
            self._stop(key[1])
            self.pods[key[1]] = self._start(key[1], obj["spec"]["template"]["spec"]["containers"][0])

    def delete_deployment(self, name: str, track: Track) -> None:
        self.calls.append(("delete", f"Deployment/{name}-{track.value}"))
        self.objects.pop(("Deployment", f"{name}-{track.value}"), None)
        self._stop(f"{name}-{track.value}")

    def wait_deployment(self, name: str, track: Track, timeout: float) -> None:
        deployment = f"{name}-{track.value}"
        probe = self.objects[("Deployment", deployment)]["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
        url = self.address(deployment) + probe["httpGet"]["path"]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise JobFailed(f"Deployment {deployment} was not Ready within {timeout:.0f}s (0/1 replicas ready): its "
                        "server did not answer /ping")

    def _start(self, deployment: str, container: dict) -> subprocess.Popen:
        env = {"POD_IP": POD_IP, **{e["name"]: e["value"] for e in container["env"] if "value" in e}}
        argv = [arg.replace("$(POD_IP)", POD_IP) for arg in container["command"]]
        if argv[0] == "python":  # the image's interpreter: this environment's
            argv[0] = sys.executable
        port = free_port()  # this pod's own address
        argv[argv.index("-p") + 1] = str(port)
        self.addresses[deployment] = f"http://{POD_IP}:{port}"
        process_env = {**os.environ, **env, "HOME": self.folder,
                       "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])}
        log = open(os.path.join(self.folder, f"{deployment}.log"), "ab")
        return subprocess.Popen(argv, env=process_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def address(self, deployment: str) -> str:
        return self.addresses[deployment]

    def _stop(self, deployment: str) -> None:
        process = self.pods.pop(deployment, None)
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def close(self) -> None:
        for deployment in list(self.pods):
            self._stop(deployment)
