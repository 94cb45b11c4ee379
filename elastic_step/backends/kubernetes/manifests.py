"""The objects the backend creates, as the client's own models: one V1Pod per worker, one
V1Secret holding the job token (mounted as a file, never in env or args), and the job's
NetworkPolicies (only the job's own worker pods reach the master and each other)."""

from __future__ import annotations

import base64
import re
import secrets
from dataclasses import dataclass, replace

from kubernetes import client as k8s

from elastic_step import defaults
from elastic_step.backends.kubernetes.options import MasterPod, PodSettings
from elastic_step.protocol import WorkerEnv

TOKEN_MOUNT = "/var/run/elastic-step/token"
TOKEN_KEY = "token"
WORKER_COMMAND = ["elastic-step", "worker"]
RUN_AS = 1000  # the images' non-root user


def dns_label(text: str, max_len: int = 40) -> str:
    """Lower-case letters, digits and dashes; starts and ends alphanumeric (RFC 1123)."""
    label = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:max_len].strip("-")
    return label or "job"


KFP_RUN_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def cluster_job_name(job_name: str, pipeline_run: str) -> str:
    """The job's name on the cluster (its `elastic-step/job` label, what `list` shows and `get`,
    `stop` and `logs` take): its own name, then its pipeline run's, since every Argo job's folder
    is `job` and every KFP task is named `train-elastic`. A KFP run id (a UUID) gives its first 8
    hex digits; an Argo workflow's name its tail, where generateName puts the random part. A retry
    of the step keeps the name (the run is the same); its instance tells the attempts apart."""
    if not pipeline_run:
        return dns_label(job_name)
    run = pipeline_run[:8] if KFP_RUN_ID.fullmatch(pipeline_run) else dns_label(pipeline_run, 63)[-24:].strip("-")
    return dns_label(f"{dns_label(job_name, 39 - len(run))}-{run}")


@dataclass
class JobNames:
    """Names and labels of one master's objects. `instance` tells two runs of the same job
    (a retried pipeline step) apart, so one master never touches another's pods."""

    job: str
    instance: str

    @classmethod
    def for_job(cls, job_name: str, suffix: str | None = None) -> "JobNames":
        job = dns_label(job_name)
        return cls(job=job, instance=f"{job}-{suffix or secrets.token_hex(3)}")

    @classmethod
    def for_master(cls, job_name: str, master: MasterPod | None, namespace: str) -> "JobNames":
        """A master pod's instance ends with its UID's first 6 characters: deploy/rbac's admission
        policy holds a pod's token to the instances that end so, so the user code one job's master
        imports cannot label a pod as another job's worker (mounting that job's token Secret,
        passing its NetworkPolicies) or change another job's objects. Elsewhere: random."""
        uid = master.uid[:6] if owns(master, namespace) else ""
        return cls.for_job(job_name, uid if re.fullmatch(r"[0-9a-z]{6}", uid) else None)

    def pod(self, worker_id: str) -> str:
        return f"{self.instance}-{dns_label(worker_id.replace('.', '-'))}"

    @property
    def secret(self) -> str:
        return f"{self.instance}-token"

    @property
    def selector(self) -> str:
        return f"app.kubernetes.io/instance={self.instance},app.kubernetes.io/component=worker"

    @property
    def worker_labels(self) -> dict[str, str]:
        """What selects this job's worker pods (and nobody else's)."""
        return {"app.kubernetes.io/instance": self.instance, "app.kubernetes.io/component": "worker"}

    def network_policy(self, role: str) -> str:
        return f"{self.instance}-{role}"

    @property
    def status_map(self) -> str:
        return f"{self.instance}-status"

    def labels(self, component: str) -> dict[str, str]:
        return {
            "app.kubernetes.io/name": "elastic-step",
            "app.kubernetes.io/part-of": "elastic-step",  # deploy/mlflow's NetworkPolicy admits these
            "app.kubernetes.io/instance": self.instance,
            "app.kubernetes.io/component": component,
            "app.kubernetes.io/managed-by": "elastic-step",
            "elastic-step/job": self.job,
        }


def owns(master: MasterPod | None, namespace: str) -> bool:
    """Whether the master pod can own objects in `namespace`: owner references never cross
    namespaces (the garbage collector would take the owner for absent and delete the objects)."""
    return master is not None and bool(master.uid) and master.namespace == namespace


def owner_references(master: MasterPod | None, namespace: str) -> list[k8s.V1OwnerReference] | None:
    # Deleting the master pod deletes its workers, Secret and NetworkPolicies (garbage collection).
    if not owns(master, namespace):
        return None
    return [k8s.V1OwnerReference(api_version="v1", kind="Pod", name=master.name, uid=master.uid)]


def token_secret(names: JobNames, master: MasterPod | None, token: str, namespace: str) -> k8s.V1Secret:
    return k8s.V1Secret(
        api_version="v1",
        kind="Secret",
        metadata=k8s.V1ObjectMeta(name=names.secret, labels=names.labels("token"),
                                  owner_references=owner_references(master, namespace)),
        type="Opaque",
        data={TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    )


def with_own_requests(settings: PodSettings, container: k8s.V1Container | None) -> PodSettings:
    """The workers' cpu and memory requests not given (--worker-cpu, --worker-memory) are the master
    container's own, as the step asked them: a namespace whose ResourceQuota requires requests
    admits the workers as it admitted the step. Only requests: a step's limit is no worker's measure."""
    own = (container.resources.requests or {}) if container is not None and container.resources else {}
    return replace(settings, cpu_request=settings.cpu_request or own.get("cpu"),
                   memory_request=settings.memory_request or own.get("memory"))


def resources(settings: PodSettings) -> k8s.V1ResourceRequirements:
    requests, limits = {}, {}
    if settings.cpu_request:
        requests["cpu"] = settings.cpu_request
    if settings.memory_request:
        requests["memory"] = settings.memory_request
    if settings.cpu_limit:
        limits["cpu"] = settings.cpu_limit
    if settings.memory_limit:
        limits["memory"] = settings.memory_limit
    if settings.gpus:
        limits["nvidia.com/gpu"] = str(settings.gpus)  # extended resources: the limit is the request
    return k8s.V1ResourceRequirements(requests=requests or None, limits=limits or None)


def threads_for(settings: PodSettings) -> str:
    """One compute thread per CPU the pod may use (1 without a limit, as the local backend)."""
    if not settings.cpu_limit:
        return "1"
    from kubernetes.utils.quantity import parse_quantity

    return str(max(1, int(parse_quantity(settings.cpu_limit))))


ISTIO_INJECT_LABEL = "sidecar.istio.io/inject"


def restricted_container() -> k8s.V1SecurityContext:
    """The container security context of every pod a job creates (PodSecurity `restricted`)."""
    return k8s.V1SecurityContext(allow_privilege_escalation=False, read_only_root_filesystem=True,
                                 run_as_non_root=True, capabilities=k8s.V1Capabilities(drop=["ALL"]))


def job_pod_spec(settings: PodSettings, names: JobNames, container: k8s.V1Container, restart_policy: str,
                 volumes: list[k8s.V1Volume]) -> k8s.V1PodSpec:
    """What a worker's and a shard's pod share: the job's token Secret and a scratch volume
    (`volumes` come after them), the settings' placement, and no API access."""
    return k8s.V1PodSpec(
        containers=[container],
        restart_policy=restart_policy,
        termination_grace_period_seconds=int(defaults.TERMINATION_GRACE_S),  # the project's one grace setting
        enable_service_links=False,
        # Workers and shards never call the API: their own service account (no Role), no token
        # mounted. Cloud workload identity (GKE, IRSA) needs no mounted token either.
        automount_service_account_token=False,
        service_account_name=settings.service_account,
        priority_class_name=settings.priority_class,
        node_selector=settings.node_selector or None,
        tolerations=[k8s.V1Toleration(**t) for t in settings.tolerations] or None,
        image_pull_secrets=[k8s.V1LocalObjectReference(name=n) for n in settings.image_pull_secrets] or None,
        security_context=k8s.V1PodSecurityContext(
            run_as_non_root=True, run_as_user=RUN_AS, run_as_group=RUN_AS, fs_group=RUN_AS,
            seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault"),
        ),
        volumes=[
            # 0440 + fsGroup: readable by the non-root process, by nobody else
            k8s.V1Volume(name="token", secret=k8s.V1SecretVolumeSource(secret_name=names.secret, default_mode=0o440)),
            k8s.V1Volume(name="scratch", empty_dir=k8s.V1EmptyDirVolumeSource()),
            *volumes,
        ],
    )


def worker_pod(
    settings: PodSettings,
    names: JobNames,
    master: MasterPod | None,
    image: str,
    worker_id: str,
    slot: int,
    master_url: str,
    extra_env: dict[str, str] | None = None,
    secret_env: list[k8s.V1EnvVar] | None = None,
    shared: tuple[list[k8s.V1Volume], list[k8s.V1VolumeMount]] = ([], []),
) -> k8s.V1Pod:
    """`secret_env`: variables that come from Secrets (store credentials), by reference only.
    `shared`: the master pod's volumes its workers mount too (`shared_volumes_of`)."""
    env = {
        **(extra_env or {}),
        WorkerEnv.MASTER_URL.value: master_url,
        WorkerEnv.TOKEN_FILE.value: f"{TOKEN_MOUNT}/{TOKEN_KEY}",
        WorkerEnv.WORKER_ID.value: worker_id,
        "OMP_NUM_THREADS": (extra_env or {}).get("OMP_NUM_THREADS", threads_for(settings)),
        # The root filesystem is read-only: caches go to the scratch volume.
        "HOME": "/tmp",
        "MPLCONFIGDIR": "/tmp/matplotlib",
    }
    if settings.gpus:
        env[WorkerEnv.COLLECTIVE_BACKEND.value] = "nccl"
    labels = {**names.labels("worker"), "elastic-step/replica-index": str(slot), "elastic-step/worker-id": dns_label(worker_id.replace(".", "-")),
              # In a namespace with Istio injection on (Kubeflow's profiles), a worker opts out: an
              # Envoy sidecar would never exit, so the pod would never end, and it would intercept
              # the gloo ports the group connects to directly.
              ISTIO_INJECT_LABEL: "false"}
    container = k8s.V1Container(
        name="worker",
        image=image,
        command=list(WORKER_COMMAND),
        env=[k8s.V1EnvVar(name=k, value=v) for k, v in env.items()]
        + [e for e in secret_env or [] if e.name not in env],
        resources=resources(settings),
        volume_mounts=[
            k8s.V1VolumeMount(name="token", mount_path=TOKEN_MOUNT, read_only=True),
            k8s.V1VolumeMount(name="scratch", mount_path="/tmp"),
            k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm"),
            *shared[1],
        ],
        security_context=restricted_container(),
    )
    spec = job_pod_spec(settings, names, container, restart_policy="Never",  # the master relaunches, not the kubelet
                        volumes=[k8s.V1Volume(name="dshm", empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory")),
                                 *shared[0]])
    return k8s.V1Pod(
        api_version="v1",
        kind="Pod",
        metadata=k8s.V1ObjectMeta(name=names.pod(worker_id), labels=labels,
                                  owner_references=owner_references(master, settings.namespace)),
        spec=spec,
    )


# What a worker needs to read the data from an object store and may not get as a value: when
# the master's own container takes these from Secrets, worker pods take them from the same ones.
STORE_CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def store_credentials_of(container: k8s.V1Container | None) -> list[k8s.V1EnvVar]:
    """The master container's store credentials that come from a Secret (`secretKeyRef`), as
    the same references; literal values are never copied into another pod's spec."""
    found = []
    for var in (container.env or []) if container is not None else []:
        source = var.value_from
        if var.name in STORE_CREDENTIAL_ENV and source is not None and source.secret_key_ref is not None:
            found.append(k8s.V1EnvVar(name=var.name, value_from=k8s.V1EnvVarSource(secret_key_ref=source.secret_key_ref)))
    return found


# Volumes a worker may share with the master: read-only data, never the master's own token or
# scratch (a PVC mounted read-only, a hostPath, a ConfigMap).
SHAREABLE_SOURCES = ("config_map", "persistent_volume_claim", "host_path")


def shared_volumes_of(pod: k8s.V1Pod | None, container: k8s.V1Container | None,
                      paths: list[str]) -> tuple[list[k8s.V1Volume], list[k8s.V1VolumeMount]]:
    """The master container's mounts at `paths` (options.SHARED_MOUNTS_ENV) and their volumes,
    for its workers: the same sources at the same paths, read-only, named `shared-N`."""
    if pod is None or container is None or not paths:
        return [], []
    by_name = {v.name: v for v in pod.spec.volumes or []}
    volumes, mounts = [], []
    for mount in container.volume_mounts or []:
        source = by_name.get(mount.name)
        if mount.mount_path.rstrip("/") not in paths or source is None:
            continue
        kind = next((k for k in SHAREABLE_SOURCES if getattr(source, k) is not None), None)
        if kind is None:
            continue
        name = f"shared-{len(volumes)}"
        volumes.append(k8s.V1Volume(name=name, **{kind: getattr(source, kind)}))
        mounts.append(k8s.V1VolumeMount(name=name, mount_path=mount.mount_path, sub_path=mount.sub_path, read_only=True))
    return volumes, mounts


# The job's status as `elastic-step get|top --backend kubernetes` reads it through the API: a
# ConfigMap the master keeps current (the master's own port admits only its workers, so no
# request from outside the job reaches it), and where `stop` leaves its request.
STATUS_KEY = "status.json"
STOP_ANNOTATION = "elastic-step/stop-requested"
SCALE_ANNOTATION = "elastic-step/workers-requested"  # `scale`: the number of workers the operator asks for
# `scale --ps`: "SHARDS/REQUEST", the shards asked for and a name the master's answer carries
# (in the status's `ps_scales`), so the same count can be asked again and its answer told apart.
PS_SCALE_ANNOTATION = "elastic-step/ps-shards-requested"
# The operator's requests, by the name the master takes them under.
REQUEST_ANNOTATIONS = {"stop": STOP_ANNOTATION, "workers": SCALE_ANNOTATION, "ps_shards": PS_SCALE_ANNOTATION}


def status_map(names: JobNames, master: MasterPod | None, namespace: str, document: str) -> k8s.V1ConfigMap:
    return k8s.V1ConfigMap(
        api_version="v1", kind="ConfigMap",
        metadata=k8s.V1ObjectMeta(name=names.status_map, labels=names.labels("status"),
                                  owner_references=owner_references(master, namespace)),
        data={STATUS_KEY: document},
    )


# Labels that change during a pod's life: never part of a selector of it.
VOLATILE_LABELS = ("workflows.argoproj.io/completed",)


def master_selector(labels: dict[str, str] | None) -> dict[str, str]:
    """What selects the master pod in its policy: its own labels (the step pod's, from Argo or
    KFP) but those that change during its life. Empty: it cannot be selected."""
    return {k: v for k, v in (labels or {}).items() if k not in VOLATILE_LABELS}


def network_policies(names: JobNames, master: MasterPod | None, namespace: str, master_labels: dict[str, str] | None,
                     master_ports: list[int] | None = None) -> list[k8s.V1NetworkPolicy]:
    """The job's data plane, closed: its worker pods admit only each other (gloo and the round's
    peer links pick their ports at random, so every port); the master pod admits only the job's worker pods (on its ports
    when known). The master pod is selected by its own labels (`master_selector`); without them
    only the workers' policy is made (the backend refuses that unless the user opted out)."""
    workers = k8s.V1LabelSelector(match_labels=names.worker_labels)
    from_workers = [k8s.V1NetworkPolicyPeer(pod_selector=workers)]
    meta = lambda role: k8s.V1ObjectMeta(  # noqa: E731
        name=names.network_policy(role), labels=names.labels("network-policy"),
        owner_references=owner_references(master, namespace))
    policies = [k8s.V1NetworkPolicy(
        api_version="networking.k8s.io/v1", kind="NetworkPolicy", metadata=meta("workers"),
        spec=k8s.V1NetworkPolicySpec(pod_selector=workers, policy_types=["Ingress"],
                                     ingress=[k8s.V1NetworkPolicyIngressRule(_from=from_workers)]),
    )]
    selector = master_selector(master_labels)
    if selector:
        ports = [k8s.V1NetworkPolicyPort(protocol="TCP", port=p) for p in master_ports or []] or None
        policies.append(k8s.V1NetworkPolicy(
            api_version="networking.k8s.io/v1", kind="NetworkPolicy", metadata=meta("master"),
            spec=k8s.V1NetworkPolicySpec(pod_selector=k8s.V1LabelSelector(match_labels=selector),
                                         policy_types=["Ingress"],
                                         ingress=[k8s.V1NetworkPolicyIngressRule(_from=from_workers, ports=ports)]),
        ))
    return policies


def to_dict(obj) -> dict:
    """The object as the API server would receive it (camelCase, no empty fields)."""
    return k8s.ApiClient().sanitize_for_serialization(obj)


def to_yaml(objects) -> str:
    import yaml

    return yaml.safe_dump_all([to_dict(o) for o in objects], sort_keys=False)


def dry_run_manifests(config, settings: PodSettings, master: MasterPod | None, image: str) -> str:
    """What `train --backend kubernetes --dry-run` prints: the Secret, the workers'
    NetworkPolicy, a --mode ps job's shard pods and their policy, and every worker pod of the first launch. The token and the API port are only
    known once the job starts (and the master's own policy once its pod's labels are read)."""
    names = JobNames.for_job(config.job_name, suffix="xxxxxx")
    url = f"http://{config.host}:{config.port or '<port chosen at start>'}"
    objects = [token_secret(names, master, "<generated when the job starts>", settings.namespace)]
    objects += network_policies(names, master, settings.namespace, None)
    if config.mode == "ps":  # the shards' pods and policy (ps_manifests.py); their tables are the model's, read at the start
        from elastic_step.backends.kubernetes.ps_manifests import ps_network_policy, ps_pod

        objects.append(ps_network_policy(names, master, settings.namespace, None))
        objects += [ps_pod(settings, names, master, image, shard, "<the model's tables and routing, when the job starts>")
                    for shard in range(config.ps_shards)]
    for slot in range(config.max_workers + config.spares):
        objects.append(worker_pod(settings, names, master, image, f"w{slot}.1", slot, url, dict(config.worker_env)))
    return to_yaml(objects)
