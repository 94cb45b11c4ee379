"""KServe's controller, played at the deploy's cluster seam for the `kserve` rollout tests: the
deploy's own ServingCluster code waits on the status this sets (its `inference_service` read is
where the reconcile happens). Taken from KServe's documented v1beta1 behaviour:

- every write of a changed predictor makes a new revision; its server here is MLflow's own
  (`mlflow models serve` of the `storageUri`, as KServe's MLflow runtime loads that location),
  a real process with an address of its own;
- the InferenceService is Ready when its newest revision answers its readiness check; a revision
  whose server exits is `Ready: False` with the reason, and it never takes traffic;
- with `canaryTrafficPercent` P < 100 the newest Ready revision takes P% and the last rolled-out
  one the rest; without it (or at 100) the newest Ready revision is rolled out;
  `canaryTrafficPercent: 0` sends all traffic to the last rolled-out revision;
- `status.components.predictor` names `latestRolledoutRevision` and `previousRolledoutRevision`.

Not modelled: Knative, the storage initializer, MLServer itself, the v2 protocol's paths."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys

import httpx

from elastic_step.release.deploy_apply import ServingCluster
from elastic_step.release.deploy_render import SERVED_VERSION_ANNOTATION
from mlflow_server import free_port


class FakeKServe(ServingCluster):
    def __init__(self, namespace: str, folder: str, mlflow_uri: str):
        self.namespace, self.folder, self.mlflow_uri = namespace, folder, mlflow_uri
        self.objects: dict[str, dict] = {}
        self.revisions: list[dict] = []  # {name, storage_uri, process, address}
        self.rolled_out: list[str] = []  # revision names, in the order they were rolled out

    def inference_service(self, name: str) -> dict | None:
        obj = self.objects.get(name)
        if obj is not None:
            self._reconcile(obj)
        return copy.deepcopy(obj)

    def write_inference_service(self, obj: dict, existing: dict | None) -> dict:
        name = obj["metadata"]["name"]
        stored = copy.deepcopy(obj)
        generation = (self.objects[name]["metadata"]["generation"] + 1) if name in self.objects else 1
        stored["metadata"]["generation"] = generation
        stored["status"] = copy.deepcopy(self.objects[name].get("status", {})) if name in self.objects else {}
        uri = stored["spec"]["predictor"]["model"]["storageUri"]
        if not self.revisions or self.revisions[-1]["storage_uri"] != uri:
            self._new_revision(name, uri)
        self.objects[name] = stored
        return copy.deepcopy(stored)

    def mark_served(self, name: str, version: str) -> None:  # a merge patch of one annotation
        self.objects[name]["metadata"].setdefault("annotations", {})[SERVED_VERSION_ANNOTATION] = version

    def roll_back_inference_service(self, name: str, annotations: dict | None = None) -> None:
        self.objects[name]["spec"]["predictor"]["canaryTrafficPercent"] = 0
        kept = self.objects[name]["metadata"].setdefault("annotations", {})
        for key, value in (annotations or {}).items():  # a merge patch: None removes
            kept.pop(key, None) if value is None else kept.__setitem__(key, value)

    def serving_address(self) -> str:
        """The address of the revision that takes all traffic (after a rollout or a rollback)."""
        return next(r["address"] for r in self.revisions if r["name"] == self.rolled_out[-1])

    def _new_revision(self, name: str, storage_uri: str) -> None:
        port = free_port()
        revision = f"{name}-predictor-{len(self.revisions) + 1:05d}"
        log = open(os.path.join(self.folder, f"{revision}.log"), "ab")
        env = {**os.environ, "MLFLOW_TRACKING_URI": self.mlflow_uri,
               "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])}
        process = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", storage_uri, "--env-manager",
                                    "local", "-h", "127.0.0.1", "-p", str(port)], env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        self.revisions.append({"name": revision, "storage_uri": storage_uri, "process": process,
                               "address": f"http://127.0.0.1:{port}"})

    def _reconcile(self, obj: dict) -> None:
        latest = self.revisions[-1]
        canary = obj["spec"]["predictor"].get("canaryTrafficPercent")
        ready, message = self._ready(latest)
        if ready and canary in (None, 100) and (not self.rolled_out or self.rolled_out[-1] != latest["name"]):
            self.rolled_out.append(latest["name"])
        predictor = {"latestCreatedRevision": latest["name"]}
        if self.rolled_out:
            predictor["latestRolledoutRevision"] = self.rolled_out[-1]
        if len(self.rolled_out) > 1:
            predictor["previousRolledoutRevision"] = self.rolled_out[-2]
        condition = {"type": "Ready", "status": "True" if ready else "False"}
        if not ready:
            condition.update(reason="RevisionFailed" if latest["process"].poll() is not None else "RevisionNotReady",
                             message=message)
        obj["status"] = {"observedGeneration": obj["metadata"]["generation"], "conditions": [condition],
                         "url": f"http://{obj['metadata']['name']}.{self.namespace}.example.com",
                         "components": {"predictor": predictor}}

    @staticmethod
    def _ready(revision: dict) -> tuple[bool, str]:
        if revision["process"].poll() is not None:
            return False, f"revision {revision['name']} failed: its server exited with code {revision['process'].returncode}"
        try:
            return httpx.get(revision["address"] + "/ping", timeout=2).status_code == 200, "not ready yet"
        except httpx.HTTPError:
            return False, f"revision {revision['name']} is not ready yet"

    def close(self) -> None:
        for revision in self.revisions:
            if revision["process"].poll() is None:
                os.killpg(revision["process"].pid, signal.SIGKILL)
                revision["process"].wait()
