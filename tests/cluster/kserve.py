"""KServe's controller for the cluster stand-in, for `serving.kserve.io/v1beta1` InferenceServices
of `modelFormat: mlflow` in Serverless mode, played over apps.py's Deployments with a token of
its own. Read from KServe (pkg/controller/v1beta1/inferenceservice: components/predictor.go,
reconcilers/knative/ksvc_reconciler.go, status.go; its `kserve-mlserver` ClusterServingRuntime;
the storage initializer's credential builder) and Knative Serving's revision and route
behaviour, never copied:

- every predictor spec that differs from the newest revision's (canaryTrafficPercent aside) is a
  new revision `NAME-predictor-NNNNN`, run as a Deployment `REVISION-deployment` owned by the
  InferenceService (`serving.knative.dev/revision` on its pods): the storage initializer as an
  init container downloads `storageUri` into `/mnt/models` with the env of the Secrets the
  predictor's service account lists (KServe's credential builder reads them from there), then the
  model server serves `/mnt/models` on 8080, its readiness probed (Knative's queue-proxy);
- with `canaryTrafficPercent` P < 100 a Ready newest revision takes P% of the requests and the
  last rolled-out one the rest; without it (or at 100) the newest Ready revision is rolled out
  and takes all of them; at 0 all of them go to the last rolled-out revision; a revision that
  takes no traffic is scaled to zero (Knative's autoscaler, minScale applying to routed ones);
- `status`: `observedGeneration`, `url` (the route's address), `address.url`, conditions
  `PredictorReady`, `IngressReady` and `Ready` (the newest revision's readiness; a revision whose
  server keeps exiting is `RevisionFailed` with the exit code), `components.predictor` with
  `latestCreatedRevision`, `latestReadyRevision`, `latestRolledoutRevision`,
  `previousRolledoutRevision` and `traffic`.

Played, not run: the storage initializer is MLflow's `download_artifacts` (which reads s3:// and
the registry's `mlflow-artifacts:` locations alike), and the model server is MLflow's own
`mlflow models serve` (its `/invocations`, not MLServer's v2 protocol paths); the route is a
listener on the node's 127.0.0.1 (`status.url`), not Istio or Kourier and DNS.
Not modelled: RawDeployment mode, transformers and explainers, other model formats, the
autoscaler's metrics, the webhooks' defaulting and validation."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import threading
import time

from kubernetes import client as k8s

from .apps import Api, ServiceProxy, owner_reference

log = logging.getLogger("cluster.kserve")

GROUP, VERSION, PLURAL = "serving.kserve.io", "v1beta1", "inferenceservices"
USER = "system:serviceaccount:kserve:kserve-controller-manager"
RULES = [
    {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "verbs": ["update"]},
    {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get", "list", "create", "update", "delete"]},
    {"apiGroups": [""], "resources": ["serviceaccounts"], "verbs": ["get"]},
]
REVISION_LABEL = "serving.knative.dev/revision"
SERVER_PORT = 8080
# KServe mounts the model at /mnt/models; the process runtime's root is the node's, read-only, where
# /mnt/models cannot be made, so here it is under the container's own /tmp.
MODEL_DIR = "/tmp/models"
# download_artifacts puts a folder's files in a folder of its name: moved up, as KServe's
# storage initializer leaves them at the mount path
DOWNLOAD = ("import os, shutil, sys, tempfile, mlflow.artifacts\n"
            "got = mlflow.artifacts.download_artifacts(artifact_uri=sys.argv[1], dst_path=tempfile.mkdtemp(dir=sys.argv[2]))\n"
            "for name in os.listdir(got):\n    shutil.move(os.path.join(got, name), sys.argv[2])\n")


def predictor_hash(predictor: dict) -> str:
    spec = {k: v for k, v in predictor.items() if k != "canaryTrafficPercent"}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]


def spread(canary: str, stable: str, percent: int) -> list[str]:
    """100 turns, `percent` of them `canary`, spread evenly (a proxy takes them in turn)."""
    return [canary if (i + 1) * percent // 100 != i * percent // 100 else stable for i in range(100)]


class KServe:
    def __init__(self, api_client: k8s.ApiClient, apps, image: str, period: float = 0.5):
        self.api, self.apps, self.image, self.period = Api(api_client), apps, image, period
        self.state: dict[str, dict] = {}  # isvc uid -> {revisions: [(name, hash)], rolled_out: [name], route: ServiceProxy}
        self.closed = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="kserve-controller")

    def start(self) -> "KServe":
        self._thread.start()
        return self

    def close(self) -> None:
        self.closed = True
        self._thread.join(timeout=10)
        for state in self.state.values():
            state["route"].close()

    def _loop(self) -> None:
        while not self.closed:
            try:
                for isvc in self.api.list(f"/apis/{GROUP}/{VERSION}/{PLURAL}"):
                    self._reconcile(isvc)
            except Exception as exc:  # a conflict or a dropped connection: the next round tries again
                if not self.closed:
                    log.info("kserve controller: %s", exc)
            time.sleep(self.period)

    def _reconcile(self, isvc: dict) -> None:
        meta, predictor = isvc["metadata"], isvc["spec"]["predictor"]
        state = self.state.setdefault(meta["uid"], {"revisions": [], "rolled_out": [], "traffic": {}})
        if "route" not in state:
            state["route"] = ServiceProxy(lambda: self._backends(meta["namespace"], state))
        digest = predictor_hash(predictor)
        if not state["revisions"] or state["revisions"][-1][1] != digest:
            name = f"{meta['name']}-predictor-{len(state['revisions']) + 1:05d}"
            self._write_revision(isvc, name, 1)
            state["revisions"].append((name, digest))
        latest = state["revisions"][-1][0]
        ready, failure = self._revision_ready(meta["namespace"], latest)
        percent = predictor.get("canaryTrafficPercent")
        if ready and percent in (None, 100) and state["rolled_out"][-1:] != [latest]:
            state["rolled_out"].append(latest)
        state["traffic"] = self._traffic(state, latest, ready, percent)
        for name, _ in state["revisions"]:  # minScale for routed revisions and a new one; the others at zero
            up = name in state["traffic"] or (name == latest and percent != 0)
            self._write_revision(isvc, name, predictor.get("minReplicas", 1) if up else 0)
        self._write_status(isvc, state, latest, ready, failure)

    @staticmethod
    def _traffic(state: dict, latest: str, ready: bool, percent) -> dict[str, int]:
        stable = state["rolled_out"][-1] if state["rolled_out"] else ""
        if not stable:
            return {latest: 100} if ready else {}
        if stable == latest or not ready or percent == 0:
            return {stable: 100}
        return {stable: 100 - percent, latest: percent}

    def _backends(self, namespace: str, state: dict) -> list[str]:
        """The route's turns: each revision's share of 100, over its Ready pods."""
        pods = {name: [self.apps.reach(p, SERVER_PORT) for p in self.apps.ready_pods(namespace, {REVISION_LABEL: name})]
                for name in state["traffic"]}
        live = {name: share for name, share in state["traffic"].items() if pods[name]}
        if len(live) == 2:
            (canary, percent), (stable, _) = sorted(live.items(), key=lambda kv: kv[0] != state["revisions"][-1][0])
            turns = spread(canary, stable, percent)
        else:
            turns = list(live)
        return [pods[name][i % len(pods[name])] for i, name in enumerate(turns)]

    # -- a revision's Deployment ----------------------------------------------------------------------
    def _write_revision(self, isvc: dict, revision: str, replicas: int) -> None:
        namespace = isvc["metadata"]["namespace"]
        path = f"/apis/apps/v1/namespaces/{namespace}/deployments"
        try:
            current = self.api.call("GET", f"{path}/{revision}-deployment")
        except k8s.ApiException as exc:
            if exc.status != 404:
                raise
            self.api.call("POST", path, self._revision_deployment(isvc, revision, replicas))
            return
        if current["spec"].get("replicas") != replicas:
            current["spec"]["replicas"] = replicas
            self.api.call("PUT", f"{path}/{revision}-deployment", current)

    def _revision_deployment(self, isvc: dict, revision: str, replicas: int) -> dict:
        meta, predictor = isvc["metadata"], isvc["spec"]["predictor"]
        model = predictor["model"]
        labels = {**(meta.get("labels") or {}), "serving.kserve.io/inferenceservice": meta["name"],
                  "component": "predictor", REVISION_LABEL: revision}
        account = predictor.get("serviceAccountName", "default")
        secrets = self.api.call("GET", f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{account}").get("secrets") or []
        mount = {"name": "kserve-provision-location", "mountPath": MODEL_DIR}
        pod = {
            "serviceAccountName": account,
            "initContainers": [{"name": "storage-initializer", "image": self.image,
                                "command": ["python", "-c", DOWNLOAD, model["storageUri"], MODEL_DIR],
                                "env": [{"name": "HOME", "value": "/tmp"}],
                                "envFrom": [{"secretRef": {"name": s["name"]}} for s in secrets],
                                "volumeMounts": [mount]}],
            "containers": [{"name": "kserve-container", "image": self.image,
                            "command": ["python", "-m", "mlflow", "models", "serve", "-m", MODEL_DIR, "--env-manager", "local",
                                        "-h", "$(POD_IP)", "-p", str(SERVER_PORT)],
                            "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                                    {"name": "HOME", "value": "/tmp"}],
                            "ports": [{"name": "user-port", "containerPort": SERVER_PORT, "protocol": "TCP"}],
                            "readinessProbe": {"httpGet": {"path": "/ping", "port": SERVER_PORT}, "periodSeconds": 1,
                                               "failureThreshold": 3},
                            "resources": model.get("resources") or {},
                            "volumeMounts": [{**mount, "readOnly": True}]}],
            "volumes": [{"name": "kserve-provision-location", "emptyDir": {}}],
        }
        return {"apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": {"name": f"{revision}-deployment", "namespace": meta["namespace"], "labels": labels,
                             "ownerReferences": [owner_reference(isvc)]},
                "spec": {"replicas": replicas, "selector": {"matchLabels": {REVISION_LABEL: revision}},
                         "template": {"metadata": {"labels": labels}, "spec": pod}}}

    def _revision_ready(self, namespace: str, revision: str) -> tuple[bool, str]:
        """(Ready, why not): Ready once a pod of it is; failed once its server has exited."""
        if self.apps.ready_pods(namespace, {REVISION_LABEL: revision}):
            return True, ""
        pods = [p for p in self.apps.pods if p["metadata"]["namespace"] == namespace
                and (p["metadata"].get("labels") or {}).get(REVISION_LABEL) == revision]
        for pod in pods:
            status = pod.get("status") or {}
            for c in status.get("initContainerStatuses", []) + status.get("containerStatuses", []):
                ended = (c.get("state") or {}).get("terminated") or (c.get("lastState") or {}).get("terminated")
                if ended and ended.get("exitCode"):
                    return False, (f'Revision "{revision}" failed with message: container {c["name"]} exited with code '
                                   f'{ended["exitCode"]}.')
        return False, f'Revision "{revision}" is not ready yet.'

    def _write_status(self, isvc: dict, state: dict, latest: str, ready: bool, failure: str) -> None:
        meta = isvc["metadata"]
        ready_revisions = [r for r, _ in state["revisions"] if r == latest and ready or r in state["rolled_out"]]
        predictor = {"latestCreatedRevision": latest, "traffic": [
            {"revisionName": r, "percent": p, "latestRevision": r == latest} for r, p in state["traffic"].items()]}
        if ready_revisions:
            predictor["latestReadyRevision"] = ready_revisions[-1]
        if state["rolled_out"]:
            predictor["latestRolledoutRevision"] = state["rolled_out"][-1]
        if len(state["rolled_out"]) > 1:
            predictor["previousRolledoutRevision"] = state["rolled_out"][-2]
        condition = {"status": "True"} if ready else {"status": "False", "reason": "RevisionFailed" if "failed" in failure
                                                      else "RevisionNotReady", "message": failure}
        url = f"http://127.0.0.1:{state['route'].port}"
        status = {"observedGeneration": meta.get("generation", 1), "url": url, "address": {"url": url},
                  "conditions": [{"type": "IngressReady", "status": "True"}, {"type": "PredictorReady", **condition},
                                 {"type": "Ready", **condition}],
                  "components": {"predictor": predictor}}
        if isvc.get("status") != status:
            body = copy.deepcopy(isvc)
            body["status"] = status
            self.api.call("PUT", f"/apis/{GROUP}/{VERSION}/namespaces/{meta['namespace']}/{PLURAL}/{meta['name']}/status", body)


def install_kserve(cluster, apps, image: str = "") -> KServe:
    """KServe installed on `cluster`: its CRD's group served, its controller running with its
    own token (the pods' image: `image`, else the cluster's project image). close() it before `apps`."""
    cluster.server.install(GROUP)
    cluster.authorizer.add_role("", "kserve-manager", RULES)
    cluster.authorizer.add_binding("", {"kind": "ClusterRole", "name": "kserve-manager"}, [{"kind": "User", "name": USER}])
    client = k8s.ApiClient(cluster.configuration(cluster.authorizer.issue_token(USER)))
    return KServe(client, apps, image or cluster.project_image).start()
