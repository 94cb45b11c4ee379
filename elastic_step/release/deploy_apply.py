"""Applying a deploy to a cluster through the official `kubernetes` client: the checks made before
anything is written, the current revision, the write, the wait for Ready and the rollback.

KServe's semantics are its documented ones (v1beta1 canary rollout): while
`canaryTrafficPercent` is set, the rest of the traffic stays on the last rolled-out revision, and
setting it to 0 sends all traffic back there. The mlflow target plays the same through two
Deployments behind one Service (see deploy_render.Track)."""

from __future__ import annotations

import time

from elastic_step.errors import ConfigError, JobFailed
from elastic_step.release.deploy_render import (PREVIOUS_VERSION_ANNOTATION, SERVED_VERSION_ANNOTATION, VERSION_LABEL,
                                                DeploySettings, Target, Track)

KSERVE_GROUP, KSERVE_VERSION, KSERVE_PLURAL = "serving.kserve.io", "v1beta1", "inferenceservices"
# The Ready condition's reasons after which KServe does not become Ready without a new spec: Knative's
# (the revision's container exited, or its image cannot be resolved), which KServe's status passes on.
FINAL_REASONS = {"RevisionFailed", "ContainerMissing"}
# A container waiting for one of these restarts or pulls again and again: it exited, or cannot start.
FINAL_WAITING = {"CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CreateContainerConfigError"}


def pod_failure(pod: dict) -> str:
    """Why a server pod will not become Ready by waiting ("" while it may): a container that exited
    with an error (its readiness fails while it is down, and it comes back to the same model), or
    one the kubelet restarts in CrashLoopBackOff or cannot start. A pod being deleted is no verdict."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return ""
    for c in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        state = c.get("state") or {}
        waiting = (state.get("waiting") or {}).get("reason", "")
        ended = state.get("terminated") or (c.get("lastState") or {}).get("terminated") or {}
        if ended.get("exitCode"):
            said = f": {ended['message'].strip()}" if (ended.get("message") or "").strip() else ""
            looping = f", {waiting}" if waiting else ""
            return (f"pod {meta.get('name')}: container {c.get('name')} exited with code {ended['exitCode']} "
                    f"({ended.get('reason') or 'Error'}{looping}){said}")
        if waiting in FINAL_WAITING:
            said = f": {(state['waiting'].get('message') or '').strip()}" if state["waiting"].get("message") else ""
            return f"pod {meta.get('name')}: container {c.get('name')} is waiting in {waiting}{said}"
    return ""


class ServingCluster:
    """The calls a deploy makes, on one namespace, with the caller's credentials."""

    def __init__(self, api_client, namespace: str):
        from kubernetes import client as k8s

        self.namespace = namespace
        self.api_client = api_client
        self.core = k8s.CoreV1Api(api_client)
        self.apps = k8s.AppsV1Api(api_client)
        self.custom = k8s.CustomObjectsApi(api_client)

    # -- checks before anything is written (bad input: exit 2) --------------------------------

    def preflight(self, target: Target, settings: DeploySettings) -> None:
        if target is Target.KSERVE and not self._serves_group(KSERVE_GROUP, KSERVE_VERSION):
            raise ConfigError(f"the cluster has no InferenceService API ({KSERVE_GROUP}/{KSERVE_VERSION}): install KServe, "
                              "or deploy with --target mlflow (a plain Deployment of MLflow's model server)")
        self._must_exist(self.core.read_namespace, (settings.namespace,), f"namespace {settings.namespace!r}",
                         "create it, or pass --namespace")
        self._must_exist(self.core.read_namespaced_service_account, (settings.service_account, settings.namespace),
                         f"service account {settings.service_account!r} in namespace {settings.namespace!r}",
                         "create it (its Secret reaches the model store), or pass --service-account")
        self._must_exist(self.core.read_namespaced_secret, (settings.storage_secret, settings.namespace),
                         f"Secret {settings.storage_secret!r} in namespace {settings.namespace!r}",
                         "create it with the model store's credentials, or pass --storage-secret")

    def _serves_group(self, group: str, version: str) -> bool:
        from kubernetes.client.rest import ApiException

        try:
            self.api_client.call_api(f"/apis/{group}/{version}", "GET", auth_settings=["BearerToken"],
                                     response_type="object", _return_http_data_only=True)
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

    @staticmethod
    def _must_exist(read, args, what: str, hint: str) -> None:
        from kubernetes.client.rest import ApiException

        try:
            read(*args)
        except ApiException as exc:
            if exc.status == 404:
                raise ConfigError(f"{what} does not exist; {hint}") from None
            if exc.status == 403:
                raise ConfigError(f"{what}: reading it was refused (403); a deploy needs get on namespaces' "
                                  "serviceaccounts and secrets") from None
            raise

    # -- KServe --------------------------------------------------------------------------------

    def inference_service(self, name: str) -> dict | None:
        return self._read(self.custom.get_namespaced_custom_object, KSERVE_GROUP, KSERVE_VERSION, self.namespace,
                          KSERVE_PLURAL, name)

    def write_inference_service(self, obj: dict, existing: dict | None) -> dict:
        from kubernetes.client.rest import ApiException

        if existing is None:
            return self.custom.create_namespaced_custom_object(KSERVE_GROUP, KSERVE_VERSION, self.namespace, KSERVE_PLURAL, obj)
        for tries_left in reversed(range(5)):
            body = {**obj, "metadata": {**obj["metadata"], "resourceVersion": existing["metadata"]["resourceVersion"]}}
            try:
                return self.custom.replace_namespaced_custom_object(KSERVE_GROUP, KSERVE_VERSION, self.namespace,
                                                                    KSERVE_PLURAL, obj["metadata"]["name"], body)
            except ApiException as exc:
                current = self.inference_service(obj["metadata"]["name"]) if exc.status == 409 else None
                # KServe's controller writes the status all the time (a new resourceVersion, the same
                # generation): written again over it; a spec someone else changed stays a conflict
                generation = existing["metadata"].get("generation")
                if not tries_left or current is None or current["metadata"].get("generation") != generation:
                    raise
                existing = current
        raise AssertionError("unreachable: the last try returns or raises")

    def wait_inference_service(self, name: str, generation: int, timeout: float) -> str:
        """The URL once the InferenceService is Ready for `generation`; JobFailed with KServe's
        own reason as soon as it reports that generation's revision failed, else when it is not
        Ready within `timeout`."""
        deadline, reason = time.monotonic() + timeout, "no status yet"
        while time.monotonic() < deadline:
            obj = self.inference_service(name) or {}
            status = obj.get("status", {})
            ready = next((c for c in status.get("conditions", []) if c.get("type") == "Ready"), None)
            if ready and status.get("observedGeneration", 0) >= generation:
                if ready.get("status") == "True":
                    return status.get("url", "")
                reason = ready.get("message") or ready.get("reason") or "not ready"
                if ready.get("reason") in FINAL_REASONS:  # waiting longer changes nothing: roll back now
                    raise JobFailed(f"InferenceService {name!r} failed its rollout: {reason}")
            time.sleep(1)
        raise JobFailed(f"InferenceService {name!r} was not Ready within {timeout:.0f}s: {reason}")

    def mark_served(self, name: str, version: str) -> None:
        patch = {"metadata": {"annotations": {SERVED_VERSION_ANNOTATION: version}}}
        self.custom.patch_namespaced_custom_object(KSERVE_GROUP, KSERVE_VERSION, self.namespace, KSERVE_PLURAL, name, patch)

    def roll_back_inference_service(self, name: str, annotations: dict | None = None) -> None:
        """All traffic back to the last rolled-out revision (KServe: canaryTrafficPercent 0), and
        `annotations` as they were before the failed rollout (None: an annotation removed)."""
        patch = {"spec": {"predictor": {"canaryTrafficPercent": 0}}}
        if annotations:
            patch["metadata"] = {"annotations": annotations}
        self.custom.patch_namespaced_custom_object(KSERVE_GROUP, KSERVE_VERSION, self.namespace, KSERVE_PLURAL, name, patch)

    # -- the mlflow target -----------------------------------------------------------------------

    def deployment(self, name: str, track: Track) -> dict | None:
        obj = self._read(self.apps.read_namespaced_deployment, f"{name}-{track.value}", self.namespace)
        return self.api_client.sanitize_for_serialization(obj) if obj is not None else None

    def served_version(self, name: str) -> tuple[str, str] | None:
        """(version, previous version) of the stable track, or None when nothing serves."""
        stable = self.deployment(name, Track.STABLE)
        if stable is None:
            return None
        meta = stable["metadata"]
        return meta.get("labels", {}).get(VERSION_LABEL, ""), meta.get("annotations", {}).get(PREVIOUS_VERSION_ANNOTATION, "")

    def write(self, obj: dict) -> None:
        """Create or replace a Deployment or Service."""
        from kubernetes.client.rest import ApiException

        kind, name = obj["kind"], obj["metadata"]["name"]
        create, replace = ((self.apps.create_namespaced_deployment, self.apps.replace_namespaced_deployment)
                           if kind == "Deployment" else (self.core.create_namespaced_service, self.core.replace_namespaced_service))
        try:
            create(self.namespace, obj)
        except ApiException as exc:
            if exc.status != 409:
                raise
            read = self.apps.read_namespaced_deployment if kind == "Deployment" else self.core.read_namespaced_service
            current = read(name, self.namespace)
            body = {**obj, "metadata": {**obj["metadata"], "resourceVersion": current.metadata.resource_version}}
            if kind == "Service":  # a Service's clusterIP is immutable once allocated
                body["spec"] = {**obj["spec"], "clusterIP": current.spec.cluster_ip}
            replace(name, self.namespace, body)

    def delete_deployment(self, name: str, track: Track) -> None:
        from kubernetes.client.rest import ApiException

        try:
            self.apps.delete_namespaced_deployment(f"{name}-{track.value}", self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def wait_deployment(self, name: str, track: Track, timeout: float) -> None:
        """Until the track's rollout is complete as `kubectl rollout status` judges it: every
        replica of the newest template is there and available, and no older one is left (an old
        Ready pod must not count for a new one that never becomes Ready). A pod of the newest
        template whose server exited or cannot start fails it at once, with the pod's reason."""
        deadline, seen = time.monotonic() + timeout, "no status yet"
        while time.monotonic() < deadline:
            obj = self.apps.read_namespaced_deployment(f"{name}-{track.value}", self.namespace)
            status, want = obj.status, obj.spec.replicas or 0
            if status is not None and (status.observed_generation or 0) >= (obj.metadata.generation or 0):
                updated, available = status.updated_replicas or 0, status.available_replicas or 0
                if updated >= want and (status.replicas or 0) <= updated and available >= want:
                    return
                seen = f"{updated}/{want} replicas updated, {available} available"
            failure = self._failed_pod(obj.spec.template.metadata.labels or {})
            if failure:  # its server exited: it is not Ready now and will not be by waiting
                raise JobFailed(f"Deployment {name}-{track.value} failed its rollout ({seen}): {failure}")
            time.sleep(1)
        raise JobFailed(f"Deployment {name}-{track.value} was not Ready within {timeout:.0f}s ({seen}): its "
                        "server did not answer /ping")

    def _failed_pod(self, template_labels: dict) -> str:
        """Why a pod of the newest template will not become Ready ("" while one may)."""
        selector = ",".join(f"{k}={v}" for k, v in sorted(template_labels.items()))
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=selector)
        for pod in self.api_client.sanitize_for_serialization(pods).get("items", []):
            reason = pod_failure(pod)
            if reason:
                return reason
        return ""

    @staticmethod
    def _read(read, *args):
        from kubernetes.client.rest import ApiException

        try:
            return read(*args)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
