"""The Kubernetes backend's settings, checked before anything starts, and the master pod's
identity (from the downward API) that worker pods point back to."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from elastic_step.errors import ConfigError

# Where Kubernetes mounts a pod's service account; its namespace file says where the pod runs.
SERVICE_ACCOUNT_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


# Workers' own identity (deploy/workers/serviceaccount.yaml): no Role, no token mounted.
WORKER_SERVICE_ACCOUNT = "elastic-step-worker"

# Mount paths of the master pod's main container that its workers get too, at the same paths
# and read-only (comma-separated; `elastic-step submit` sets it): the model definition's
# ConfigMap, a data volume. Workers then open the same paths the master was given.
SHARED_MOUNTS_ENV = "ELASTIC_STEP_WORKER_MOUNTS"


def shared_mounts() -> list[str]:
    return [p.rstrip("/") for p in os.environ.get(SHARED_MOUNTS_ENV, "").split(",") if p.strip()]


@dataclass
class MasterPod:
    """The pod the master runs in: its workers' owner, and the address they call. `namespace`
    is where it runs ("" when unknown): owner references never cross namespaces."""

    name: str
    uid: str
    ip: str
    namespace: str = ""


@dataclass
class PodSettings:
    namespace: str
    image: str | None  # None: the master pod's own image (looked up), else the default image
    cpu_request: str | None = None
    cpu_limit: str | None = None
    memory_request: str | None = None
    memory_limit: str | None = None
    gpus: int = 0
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict] = field(default_factory=list)  # V1Toleration fields, snake_case
    priority_class: str | None = None
    image_pull_secrets: list[str] = field(default_factory=list)
    service_account: str = WORKER_SERVICE_ACCOUNT
    pending_timeout_s: float = 300.0
    # The master pod's own NetworkPolicy (only its workers reach its API and its store) is required:
    # False is the user's explicit opt-out (`--no-master-network-policy`), never a silent fallback.
    master_network_policy: bool = True
    # The Secret worker pods take the data store's keys from (store_access.py); None: the default.
    worker_store_secret: str | None = None
    # A --mode ps job's shard pods: (request, limit) of cpu and of memory; None: a worker's.
    ps_cpu: tuple[str | None, str | None] | None = None
    ps_memory: tuple[str | None, str | None] | None = None


def parse_quantity(option: str, text: str) -> float:
    from kubernetes.utils.quantity import parse_quantity as parse

    try:
        return float(parse(text))
    except (ValueError, TypeError):
        raise ConfigError(
            f"{option} {text!r} is not a Kubernetes quantity (e.g. 500m or 2 for CPU, 512Mi or 4Gi for memory)"
        ) from None


def request_and_limit(option: str, text: str | None) -> tuple[str | None, str | None]:
    """`REQUEST` (the limit is the same) or `REQUEST:LIMIT`."""
    if not text:
        return None, None
    request, _, limit = str(text).partition(":")
    limit = limit or request
    if parse_quantity(option, request) > parse_quantity(option, limit):
        raise ConfigError(f"{option} {text!r}: the request {request} is larger than the limit {limit}")
    return request, limit


def parse_node_selector(items: list[str]) -> dict[str, str]:
    selector = {}
    for item in items:
        for pair in filter(None, str(item).split(",")):
            key, sep, value = pair.partition("=")
            if not sep or not key:
                raise ConfigError(f"--node-selector {pair!r} is not KEY=VALUE (e.g. cloud.google.com/gke-nodepool=gpu)")
            selector[key.strip()] = value.strip()
    return selector


def parse_toleration(text: str) -> dict:
    """`KEY[=VALUE][:EFFECT]`: Equal with a value, Exists without; every effect without one."""
    spec, _, effect = str(text).partition(":")
    key, sep, value = spec.partition("=")
    if not key:
        raise ConfigError(f"--toleration {text!r} is not KEY[=VALUE][:EFFECT] (e.g. nvidia.com/gpu:NoSchedule)")
    if effect and effect not in TAINT_EFFECTS:
        raise ConfigError(f"--toleration {text!r}: effect {effect!r} is not one of {', '.join(TAINT_EFFECTS)}")
    toleration = {"key": key, "operator": "Equal" if sep else "Exists"}
    if sep:
        toleration["value"] = value
    if effect:
        toleration["effect"] = effect
    return toleration


def pod_namespace() -> str:
    """The namespace of the pod this process runs in (downward API, else the mounted service
    account's namespace file), or "" outside a pod."""
    if os.environ.get("ELASTIC_STEP_POD_NAMESPACE"):
        return os.environ["ELASTIC_STEP_POD_NAMESPACE"]
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE_FILE, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return ""


def current_namespace() -> str:
    """The namespace this process runs in: the downward API, the service account, the
    kubeconfig's current context, else `default`."""
    if pod_namespace():
        return pod_namespace()
    try:
        from kubernetes import config as kube_config

        _, context = kube_config.list_kube_config_contexts()
        return context.get("context", {}).get("namespace") or "default"
    except Exception:  # no kubeconfig at all: the client's own default
        return "default"


def master_pod_from_env() -> MasterPod | None:
    """The downward API's view of the master pod (ELASTIC_STEP_POD_NAME/UID/NAMESPACE/IP; KFP's
    own KFP_POD_NAME/KFP_POD_UID also count). None outside a pod. A missing UID is read from
    the pod object when the backend starts."""
    name = os.environ.get("ELASTIC_STEP_POD_NAME") or os.environ.get("KFP_POD_NAME")
    uid = os.environ.get("ELASTIC_STEP_POD_UID") or os.environ.get("KFP_POD_UID")
    ip = os.environ.get("ELASTIC_STEP_POD_IP", "")
    if not name:
        return None
    return MasterPod(name=name, uid=uid or "", ip=ip, namespace=pod_namespace())


def settings_from_config(config) -> PodSettings:
    """Every Kubernetes option of a TrainConfig, checked; raises ConfigError naming the option."""
    from elastic_step.backends.kubernetes.store_access import WORKER_STORE_SECRET_ENV, check_secret_name

    cpu_request, cpu_limit = request_and_limit("--worker-cpu", config.worker_cpu)
    memory_request, memory_limit = request_and_limit("--worker-memory", config.worker_memory)
    if config.worker_gpus < 0:
        raise ConfigError(f"--worker-gpus must be 0 or more, got {config.worker_gpus}")
    if config.pending_timeout <= 0:
        raise ConfigError(f"--pending-timeout must be positive, got {config.pending_timeout}")
    return PodSettings(
        namespace=config.namespace or current_namespace(),
        image=config.image,
        cpu_request=cpu_request,
        cpu_limit=cpu_limit,
        memory_request=memory_request,
        memory_limit=memory_limit,
        gpus=config.worker_gpus,
        node_selector=parse_node_selector(config.node_selector),
        tolerations=[parse_toleration(t) for t in config.tolerations],
        priority_class=config.priority_class,
        image_pull_secrets=list(config.image_pull_secrets),
        service_account=config.service_account or WORKER_SERVICE_ACCOUNT,
        pending_timeout_s=config.pending_timeout,
        master_network_policy=config.master_network_policy,
        worker_store_secret=check_secret_name(config.worker_store_secret or os.environ.get(WORKER_STORE_SECRET_ENV)),
        ps_cpu=request_and_limit("--ps-cpu", config.ps_cpu) if getattr(config, "ps_cpu", None) else None,
        ps_memory=request_and_limit("--ps-memory", config.ps_memory) if getattr(config, "ps_memory", None) else None,
    )


def check_config(config) -> None:
    """Called by TrainConfig for `--backend kubernetes`: fail on bad options before anything
    starts, and listen on the master pod's IP (workers in other pods call it there)."""
    from elastic_step.frameworks.device import check_gpu_request

    settings_from_config(config)
    # The workers' image as named, else in a pod the master pod's own, whose torch says whether it
    # has CUDA (outside a pod, with no name, the image is not judged: a check of a dry run's defaults).
    named = config.image or os.environ.get("ELASTIC_STEP_IMAGE") or ""
    in_pod = bool(os.environ.get("ELASTIC_STEP_POD_IP"))
    check_gpu_request(config.worker_gpus, config.device, named, own=not named and in_pod)
    pod_ip = os.environ.get("ELASTIC_STEP_POD_IP")
    if pod_ip and config.host == "127.0.0.1":
        config.host = pod_ip


def check_master_reachable(config) -> None:
    """What worker pods must reach, checked before anything starts (no job folder, no pod, no
    Secret): the master, which they cannot call on loopback outside their pod, and the data,
    which they cannot read from a path of the master's own filesystem."""
    if config.host in ("127.0.0.1", "localhost", "0.0.0.0") and not os.environ.get("ELASTIC_STEP_POD_IP"):
        raise ConfigError(
            f"--backend kubernetes: worker pods cannot reach a master listening on {config.host}; run the "
            "master in a pod with ELASTIC_STEP_POD_IP set from the downward API (status.podIP), or pass "
            "--host with an address the pods can reach"
        )
    check_data_readable_by_pods(config.data)


def check_data_readable_by_pods(data: str) -> None:
    """Worker pods share no file with the master's pod: a local `--data` path (or file:// URI) is
    a folder only the master can read, so the job would fail in every worker (unless it lies on
    a volume the workers mount too: SHARED_MOUNTS_ENV)."""
    from elastic_step.data.stores import is_local

    path = str(data).removeprefix("file://")
    if is_local(str(data)) and not any(path == m or path.startswith(m + "/") for m in shared_mounts()):
        raise ConfigError(
            f"--data {data!r} is a local path, which worker pods of --backend kubernetes cannot read; put the "
            "prepared dataset in an object store and pass its URI (s3://bucket/prefix, gs://...; Argo: render "
            "with --data-store)"
        )
