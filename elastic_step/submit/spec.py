"""The objects one submission makes, as the client's own models: the master pod, and the model
definition's ConfigMap when it is a local file. Nothing here talks to the API.

The master pod is the pipelines' train step (elastic_step/argo/steps.py, the KFP component):
`elastic-step train --backend kubernetes` as the `main` container, the downward-API variables
that tell the master who and where it is, deploy/rbac's service account. Every secret reaches it
by `secretKeyRef`; the master hands the store's references (never values) to its workers, and
the folders named in SHARED_MOUNTS_ENV (the model definition, a data volume) are mounted in its
workers at the same paths."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kubernetes import client as k8s

from elastic_step import defaults
from elastic_step.backends.kubernetes.manifests import RUN_AS
from elastic_step.backends.kubernetes.options import SHARED_MOUNTS_ENV
from elastic_step.errors import ConfigError

# The downward API, as the Argo train step and the KFP component set it (tests keep them equal):
# the master's pod owns its workers, they go to its namespace and call its address.
MASTER_ENV = (("ELASTIC_STEP_POD_NAME", "metadata.name"), ("ELASTIC_STEP_POD_UID", "metadata.uid"),
              ("ELASTIC_STEP_POD_NAMESPACE", "metadata.namespace"), ("ELASTIC_STEP_POD_IP", "status.podIP"))
MASTER_SERVICE_ACCOUNT = "elastic-step-runner"  # deploy/rbac/serviceaccount.yaml, bound to the master's Role
SCRATCH = "/tmp"  # the master pod's emptyDir: its job folder (the root filesystem is read-only)
MODEL_MOUNT = "/elastic-step/model-def"  # a folder no image has: the ConfigMap's own
JOB_LABEL = "elastic-step/job"  # on every object of the job, the master's own included
CONFIG_MAP_LIMIT = 1024 * 1024  # the API server refuses a ConfigMap whose data exceeds 1 MiB
# The keys of the Secrets named by --store-secret and --mlflow-secret (the Argo templates' own).
STORE_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
MLFLOW_KEYS = ("username", "password")


@dataclass(frozen=True)
class Volume:
    """`--volume claim=NAME,mount_path=/data` or ElasticDL's `host_path=/data,mount_path=/data`."""

    name: str
    mount_path: str
    claim: str | None = None
    host_path: str | None = None
    read_only: bool = False

    def source(self) -> k8s.V1Volume:
        if self.claim:
            return k8s.V1Volume(name=self.name, persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(
                claim_name=self.claim, read_only=self.read_only or None))
        return k8s.V1Volume(name=self.name, host_path=k8s.V1HostPathVolumeSource(path=self.host_path, type="Directory"))

    def mount(self) -> k8s.V1VolumeMount:
        return k8s.V1VolumeMount(name=self.name, mount_path=self.mount_path, read_only=self.read_only or None)


def parse_volume(text: str, index: int) -> Volume:
    fields = {}
    for pair in filter(None, (p.strip() for p in str(text).split(","))):
        key, sep, value = pair.partition("=")
        if not sep or not value:
            raise ConfigError(f"--volume {text!r}: {pair!r} is not KEY=VALUE (claim=NAME,mount_path=/data or "
                              "host_path=/data,mount_path=/data)")
        fields[key.strip().replace("-", "_")] = value.strip()
    claim = fields.pop("claim", None) or fields.pop("claim_name", None)
    host_path, mount_path = fields.pop("host_path", None), fields.pop("mount_path", None)
    read_only = fields.pop("read_only", "false").lower() in ("true", "1", "yes")
    if fields or not mount_path or (claim is None) == (host_path is None):
        raise ConfigError(f"--volume {text!r} needs mount_path and one of claim or host_path "
                          "(e.g. claim=training-data,mount_path=/data)")
    if not mount_path.startswith("/") or (host_path is not None and not host_path.startswith("/")):
        raise ConfigError(f"--volume {text!r}: paths must be absolute")
    if mount_path.rstrip("/") in (SCRATCH, MODEL_MOUNT) or mount_path == "/":
        raise ConfigError(f"--volume {text!r}: {mount_path} is the master pod's own; mount the volume elsewhere (e.g. /data)")
    return Volume(name=f"volume-{index}", mount_path=mount_path.rstrip("/"), claim=claim, host_path=host_path,
                  read_only=read_only)


@dataclass
class Submission:
    """One job as `submit` makes it. `train_args`: the master's `train` options, already
    rewritten for the pod (job folder, model definition path)."""

    job: str
    namespace: str
    image: str
    train_args: list[str]
    model_file: str | None = None  # a local .py shipped in the ConfigMap
    volumes: list[Volume] = field(default_factory=list)
    mlflow_uri: str | None = None
    mlflow_secret: str | None = None
    store_secret: str | None = None
    priority_class: str | None = None
    image_pull_secrets: list[str] = field(default_factory=list)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict] = field(default_factory=list)
    worker_service_account: str = "elastic-step-worker"
    master_cpu: tuple[str | None, str | None] = (None, None)  # (request, limit)
    master_memory: tuple[str | None, str | None] = (None, None)

    @property
    def pod_name(self) -> str:
        return f"{self.job}-master"

    @property
    def config_map_name(self) -> str:
        return f"{self.job}-model-def"

    @property
    def job_dir(self) -> str:
        return f"{SCRATCH}/{self.job}"  # the master names the job after its folder

    @property
    def model_key(self) -> str:
        return os.path.basename(self.model_file or "")

    @property
    def model_path(self) -> str:
        return f"{MODEL_MOUNT}/{self.model_key}"

    @property
    def shared_mounts(self) -> list[str]:
        """What the workers see as the master does: the model definition and the data volumes."""
        return ([MODEL_MOUNT] if self.model_file else []) + [v.mount_path for v in self.volumes]


def labels(job: str, component: str) -> dict[str, str]:
    """The submitted objects' labels. `app.kubernetes.io/part-of` lets deploy/mlflow's
    NetworkPolicy admit the master; no `managed-by`, which `list` reads as a job's worker."""
    return {"app.kubernetes.io/name": "elastic-step", "app.kubernetes.io/part-of": "elastic-step",
            "app.kubernetes.io/component": component, JOB_LABEL: job}


def master_labels(job: str) -> dict[str, str]:
    """The master pod's: it calls MLflow, so deploy/mlflow's NetworkPolicy admits it by this label."""
    return {**labels(job, "master"), defaults.MLFLOW_CLIENT_LABEL[0]: defaults.MLFLOW_CLIENT_LABEL[1]}


def model_config_map(sub: Submission) -> k8s.V1ConfigMap:
    with open(sub.model_file, encoding="utf-8") as f:
        source = f.read()
    return k8s.V1ConfigMap(api_version="v1", kind="ConfigMap",
                           metadata=k8s.V1ObjectMeta(name=sub.config_map_name, labels=labels(sub.job, "model-def")),
                           data={sub.model_key: source})


def _secret_env(name: str, secret: str, key: str) -> k8s.V1EnvVar:
    return k8s.V1EnvVar(name=name, value_from=k8s.V1EnvVarSource(secret_key_ref=k8s.V1SecretKeySelector(name=secret, key=key)))


def master_env(sub: Submission) -> list[k8s.V1EnvVar]:
    env = [k8s.V1EnvVar(name=n, value_from=k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(field_path=f)))
           for n, f in MASTER_ENV]
    env += [k8s.V1EnvVar(name="ELASTIC_STEP_IMAGE", value=sub.image),
            # The root filesystem is read-only: caches go to the scratch volume.
            k8s.V1EnvVar(name="HOME", value=SCRATCH), k8s.V1EnvVar(name="MPLCONFIGDIR", value=f"{SCRATCH}/matplotlib")]
    if sub.shared_mounts:
        env.append(k8s.V1EnvVar(name=SHARED_MOUNTS_ENV, value=",".join(sub.shared_mounts)))
    if sub.mlflow_uri:
        env.append(k8s.V1EnvVar(name="MLFLOW_TRACKING_URI", value=sub.mlflow_uri))
    if sub.mlflow_secret:  # MLflow's basic-auth server (deploy/mlflow): a user, never a literal
        env += [_secret_env(f"MLFLOW_TRACKING_{key.upper()}", sub.mlflow_secret, key) for key in MLFLOW_KEYS]
        if not sub.mlflow_uri:  # the URI the user is for, from the same Secret
            env.append(_secret_env("MLFLOW_TRACKING_URI", sub.mlflow_secret, "uri"))
    if sub.store_secret:  # by reference: the master gives its workers the same references
        env += [_secret_env(key, sub.store_secret, key) for key in STORE_KEYS]
    return env


def _resources(sub: Submission) -> k8s.V1ResourceRequirements:
    requests, limits = {}, {}
    for name, (request, limit) in (("cpu", sub.master_cpu), ("memory", sub.master_memory)):
        if request:
            requests[name], limits[name] = request, limit
    return k8s.V1ResourceRequirements(requests=requests or None, limits=limits or None)


def master_pod(sub: Submission) -> k8s.V1Pod:
    mounts = [k8s.V1VolumeMount(name="scratch", mount_path=SCRATCH)]
    volumes = [k8s.V1Volume(name="scratch", empty_dir=k8s.V1EmptyDirVolumeSource())]
    if sub.model_file:
        mounts.append(k8s.V1VolumeMount(name="model-def", mount_path=MODEL_MOUNT, read_only=True))
        volumes.append(k8s.V1Volume(name="model-def", config_map=k8s.V1ConfigMapVolumeSource(
            name=sub.config_map_name, default_mode=0o444)))
    mounts += [v.mount() for v in sub.volumes]
    volumes += [v.source() for v in sub.volumes]
    container = k8s.V1Container(
        name="main",  # the name the backend looks for: workers run this container's image
        image=sub.image, command=["elastic-step", "train"], args=list(sub.train_args), env=master_env(sub),
        resources=_resources(sub), volume_mounts=mounts,
        # PodSecurity `restricted`: non-root, no privilege escalation, no capabilities, RuntimeDefault seccomp.
        security_context=k8s.V1SecurityContext(allow_privilege_escalation=False, read_only_root_filesystem=True,
                                               run_as_non_root=True, capabilities=k8s.V1Capabilities(drop=["ALL"])),
    )
    spec = k8s.V1PodSpec(
        containers=[container], volumes=volumes,
        restart_policy="Never",  # a new attempt is `submit ... --resume`: it continues the job's MLflow run
        service_account_name=MASTER_SERVICE_ACCOUNT, enable_service_links=False,
        priority_class_name=sub.priority_class, node_selector=sub.node_selector or None,
        tolerations=[k8s.V1Toleration(**t) for t in sub.tolerations] or None,
        image_pull_secrets=[k8s.V1LocalObjectReference(name=n) for n in sub.image_pull_secrets] or None,
        security_context=k8s.V1PodSecurityContext(run_as_non_root=True, run_as_user=RUN_AS, run_as_group=RUN_AS,
                                                  fs_group=RUN_AS,
                                                  seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault")),
    )
    return k8s.V1Pod(api_version="v1", kind="Pod",
                     metadata=k8s.V1ObjectMeta(name=sub.pod_name, labels=master_labels(sub.job)), spec=spec)


def objects(sub: Submission) -> list:
    """Everything `submit` creates, in the order it creates them."""
    return ([model_config_map(sub)] if sub.model_file else []) + [master_pod(sub)]


def to_yaml(items: list) -> str:
    """What `--dry-run` prints: the objects as the API server receives them, a multi-line value
    (the model definition's source) as a literal block that reads like the file."""
    import yaml

    from elastic_step.backends.kubernetes.manifests import to_dict

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper, value: str):
        block = "\n" in value and not any(line != line.rstrip() for line in value.splitlines())
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if block else None)

    Dumper.add_representer(str, text)
    return yaml.dump_all([to_dict(o) for o in items], Dumper=Dumper, sort_keys=False)
