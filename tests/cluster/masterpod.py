"""A pod whose main container is an elastic master, watched from the node: its job folder as
the node holds it (how depends on the pod: `path`), its status through the master's own API
with the token it wrote there, and its phase and log through the API server."""

from __future__ import annotations

import json
import time

import httpx
from kubernetes import client as k8s

from elastic_step.protocol import API


class MasterPodOnNode:
    def __init__(self, cluster, name: str, job_dir: str, what: str = "master pod"):
        self.cluster, self.name, self.job_dir, self.what = cluster, name, job_dir, what

    def path(self, pod_path: str) -> str:
        """Where the node holds a file of the pod's filesystem."""
        raise NotImplementedError

    def reach(self, url: str) -> str:
        """The master's URL as the test calls it (on a pod network: through a port-forward)."""
        return url

    def status(self) -> dict | None:
        try:
            with open(self.path(f"{self.job_dir}/master.json")) as f:
                info = json.load(f)
            with open(self.path(info["token_file"])) as f:
                token = f.read().strip()
            reply = httpx.get(self.reach(info["url"]) + API + "/status", headers={"Authorization": f"Bearer {token}"}, timeout=5)
            return reply.json() if reply.status_code == 200 else None
        except (OSError, ValueError, KeyError, httpx.HTTPError):
            return None

    def phase(self) -> str:
        return self.cluster.core().read_namespaced_pod(self.name, self.cluster.namespace).status.phase

    def log(self) -> str:
        """Every container's log, init containers first (`kubectl logs --all-containers`): the API
        answers one container at a time when a pod has several (Argo's `wait` beside `main`)."""
        api, ns = self.cluster.core(), self.cluster.namespace
        spec = api.read_namespaced_pod(self.name, ns).spec
        texts = []
        for container in (spec.init_containers or []) + spec.containers:
            try:
                texts.append(api.read_namespaced_pod_log(self.name, ns, container=container.name))
            except k8s.ApiException as exc:  # a container that never started has no log
                if exc.status != 400:
                    raise
        return "".join(texts)

    def wait_ended(self, timeout: float) -> str:
        """The pod's phase once it has ended (or whatever it is when `timeout` runs out)."""
        deadline = time.monotonic() + timeout
        while self.phase() not in ("Succeeded", "Failed") and time.monotonic() < deadline:
            time.sleep(0.2)
        return self.phase()

    def wait(self, predicate, timeout=120.0) -> dict:
        deadline = time.monotonic() + timeout
        status = None
        while time.monotonic() < deadline:
            if self.phase() in ("Succeeded", "Failed"):
                raise AssertionError(f"the {self.what} ended ({self.phase()}) before the condition; last status {status}\n{self.log()}")
            status = self.status()
            if status is not None and predicate(status):
                return status
            time.sleep(0.1)
        raise AssertionError(f"condition not reached in {timeout}s; last status {status}\n{self.log()}")
