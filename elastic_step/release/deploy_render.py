"""The objects a deploy writes, as plain Kubernetes dicts: a KServe InferenceService (`kserve`), or
a Deployment per track and one Service (`mlflow`, MLflow's own model server). Pure functions of
the resolved version and the settings, so what is applied is what the tests validate."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum

from elastic_step.release.served_model import ServedModel, kserve_format

LABEL_PREFIX = "elastic-step.io"
MODEL_LABEL = f"{LABEL_PREFIX}/registered-model"
VERSION_LABEL = f"{LABEL_PREFIX}/model-version"
RUN_LABEL = f"{LABEL_PREFIX}/mlflow-run"
TRACK_LABEL = f"{LABEL_PREFIX}/track"
MODEL_ANNOTATION = f"{LABEL_PREFIX}/registered-model-name"  # the exact name, which a label may not hold
PREVIOUS_VERSION_ANNOTATION = f"{LABEL_PREFIX}/previous-version"  # what a rollback returns to
# The version whose revision takes the traffic: the labels name the spec's version, which may be a
# canary that failed and was rolled back. Set once a rollout is Ready.
SERVED_VERSION_ANNOTATION = f"{LABEL_PREFIX}/served-version"
SERVER_PORT = 8080


class Target(str, Enum):
    KSERVE = "kserve"
    MLFLOW = "mlflow"


class Track(str, Enum):
    """The mlflow target's two Deployments: `stable` serves; `canary` holds a new version for its
    share of the Service's endpoints until it is Ready and takes over."""

    STABLE = "stable"
    CANARY = "canary"


@dataclass(frozen=True)
class DeploySettings:
    namespace: str
    name: str  # the InferenceService / Service name
    service_account: str
    storage_secret: str  # the Secret whose keys reach the model store (env of the mlflow target's server)
    mlflow_uri: str = ""  # the registry as pods reach it (mlflow target); no password: that is in the Secret
    image: str = ""  # the mlflow target's image (elastic-step's own has mlflow and the frameworks)
    replicas: int = 1
    port: int = SERVER_PORT  # the mlflow target's server port in its pod
    canary_percent: int = 10
    resources: dict = field(default_factory=lambda: {"requests": {"cpu": "500m", "memory": "1Gi"},
                                                     "limits": {"cpu": "2", "memory": "2Gi"}})


def label_value(text: str) -> str:
    """`text` as a label value: at most 63 of [A-Za-z0-9._-], alphanumeric at both ends."""
    value = re.sub(r"[^A-Za-z0-9._-]+", "-", text)[:63]
    return value.strip("._-") or "model"


def object_name(text: str) -> str:
    """A DNS-1035 label (what a Service and an InferenceService name must be) made from `text`."""
    value = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    if not value or not value[0].isalpha():
        value = f"m-{value}"
    return value[:45].rstrip("-")  # room for KServe's "-predictor-00001" and our "-canary"


def model_labels(model: ServedModel) -> dict[str, str]:
    return {MODEL_LABEL: label_value(model.name), VERSION_LABEL: model.version, RUN_LABEL: label_value(model.run_id)}


def inference_service(model: ServedModel, settings: DeploySettings, canary: bool, previous_version: str = "") -> dict:
    """KServe's InferenceService for `model`: storageUri from the registry, the service account
    that KServe's storage initializer reads the store's credentials through, and
    `canaryTrafficPercent` when a previous revision serves (KServe then keeps the rest of the
    traffic on the last rolled-out revision)."""
    predictor = {
        "serviceAccountName": settings.service_account,
        "automountServiceAccountToken": False,  # the predictor runs the user's model code and never calls the API
        "minReplicas": settings.replicas,
        "model": {
            "modelFormat": {"name": kserve_format(model)},
            "protocolVersion": "v2",  # MLServer's MLflow runtime speaks the open inference protocol
            "storageUri": model.storage_uri,
            "resources": settings.resources,
        },
    }
    if canary:
        predictor["canaryTrafficPercent"] = settings.canary_percent
    annotations = {MODEL_ANNOTATION: model.name}
    if previous_version:  # it serves until this revision is Ready
        annotations[PREVIOUS_VERSION_ANNOTATION] = annotations[SERVED_VERSION_ANNOTATION] = previous_version
    return {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": {"name": settings.name, "namespace": settings.namespace, "labels": _labels(model, settings),
                     "annotations": annotations},
        "spec": {"predictor": predictor},
    }


def _labels(model: ServedModel, settings: DeploySettings, track: Track | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "elastic-step-model-server", "app.kubernetes.io/instance": settings.name,
              "app.kubernetes.io/managed-by": "elastic-step", **model_labels(model)}
    if track is not None:
        labels[TRACK_LABEL] = track.value
    return labels


def model_service(model: ServedModel, settings: DeploySettings) -> dict:
    """The one Service of the mlflow target: both tracks' Ready pods are its endpoints, so the
    canary's share of the traffic is its share of the Ready replicas."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": settings.name, "namespace": settings.namespace, "labels": _labels(model, settings),
                     "annotations": {MODEL_ANNOTATION: model.name}},
        "spec": {"selector": {"app.kubernetes.io/instance": settings.name, "app.kubernetes.io/name": "elastic-step-model-server"},
                 "ports": [{"name": "http", "port": 80, "targetPort": settings.port, "protocol": "TCP"}]},
    }


def canary_replicas(settings: DeploySettings) -> int:
    """Replicas of the canary track for its percentage of the stable track's (at least one)."""
    return max(1, round(settings.replicas * settings.canary_percent / max(1, 100 - settings.canary_percent)))


def model_deployment(model: ServedModel, settings: DeploySettings, track: Track, previous_version: str = "") -> dict:
    """A Deployment of MLflow's model server for the exact version, ready when /ping answers."""
    labels = _labels(model, settings, track)
    annotations = {MODEL_ANNOTATION: model.name}
    if previous_version:
        annotations[PREVIOUS_VERSION_ANNOTATION] = previous_version
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": f"{settings.name}-{track.value}", "namespace": settings.namespace, "labels": labels,
                     "annotations": annotations},
        "spec": {
            "replicas": settings.replicas if track is Track.STABLE else canary_replicas(settings),
            "selector": {"matchLabels": {"app.kubernetes.io/instance": settings.name, TRACK_LABEL: track.value}},
            "template": {"metadata": {"labels": labels, "annotations": annotations},
                         "spec": _server_pod(model, settings)},
        },
    }


def _server_pod(model: ServedModel, settings: DeploySettings) -> dict:
    return {
        "serviceAccountName": settings.service_account,
        "automountServiceAccountToken": False,  # the server never calls the API
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{
            "name": "model-server",
            "image": settings.image,
            "command": ["python", "-m", "mlflow", "models", "serve", "-m", model.model_uri, "--env-manager", "local",
                        "-h", "$(POD_IP)", "-p", str(settings.port)],
            "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    {"name": "MLFLOW_TRACKING_URI", "value": settings.mlflow_uri},
                    {"name": "HOME", "value": "/tmp"}],
            # the store's and the registry's credentials (AWS_*, MLFLOW_TRACKING_USERNAME/PASSWORD)
            "envFrom": [{"secretRef": {"name": settings.storage_secret}}],
            "ports": [{"name": "http", "containerPort": settings.port, "protocol": "TCP"}],
            "readinessProbe": {"httpGet": {"path": "/ping", "port": settings.port}, "periodSeconds": 2,
                               "failureThreshold": 3},
            "resources": settings.resources,
            "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                "capabilities": {"drop": ["ALL"]}},
            "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        }],
        "volumes": [{"name": "tmp", "emptyDir": {}}],  # the downloaded model, with a read-only root
    }
