"""The manifests of a `--mode ps` job's shard pods and of the NetworkPolicy that admits only the
job's workers and master to them (ps_pods.py says how the pods are run and watched)."""

from __future__ import annotations

import json
from dataclasses import replace

from kubernetes import client as k8s

from elastic_step.backends.kubernetes.manifests import (ISTIO_INJECT_LABEL, TOKEN_KEY, TOKEN_MOUNT, JobNames, job_pod_spec,
                                                         master_selector, owner_references, resources,
                                                         restricted_container)
from elastic_step.backends.kubernetes.options import MasterPod, PodSettings
from elastic_step.protocol import WorkerEnv
from elastic_step.ps.api import TableSpec
from elastic_step.ps.routing import DEFAULT_VIRTUAL_SHARDS, RoutingTable

PS_PORT = 7460  # shard I listens on PS_PORT + I (distinct even where pods share the node's network)
DATA_DIR = "/tmp/ps"  # the shard's folder, on the pod's scratch emptyDir: kept across container restarts
CONFIG_ENV = "ELASTIC_STEP_PS_CONFIG"  # the shard's config.json (tables, routing): no secret in it
POD_IP_ENV = "ELASTIC_STEP_POD_IP"
DIR_ENV = "ELASTIC_STEP_PS_DIR"  # paths in the env, not the command: where a runtime relocates mounts, it rewrites the env
RESTORE_ENV = "ELASTIC_STEP_PS_RESTORE"  # a resumed shard's cut: {"step", "digest", "routing"} (ps_cuts.py); no secret in it
SHARD_LABEL = "elastic-step/ps-shard"
COMPONENT = "ps"



def ps_labels(names: JobNames) -> dict[str, str]:
    """What selects this job's shard pods (and nobody else's)."""
    return {"app.kubernetes.io/instance": names.instance, "app.kubernetes.io/component": COMPONENT}


def ps_selector(names: JobNames) -> str:
    return ",".join(f"{k}={v}" for k, v in ps_labels(names).items())


def ps_pod_name(names: JobNames, shard: int) -> str:
    return f"{names.instance}-ps-{shard}"


def shard_config(specs: list[TableSpec], routing: RoutingTable, snapshot_every: int = 1000, checkpoint_every: int = 0) -> str:
    """The shard's config.json; `checkpoint_every`: the job's --checkpoint-steps, whose multiples
    it cuts ahead (ps/cuts.py)."""
    return json.dumps({"tables": [s.to_json() for s in specs], "routing": routing.to_json(), "snapshot_every": snapshot_every,
                       "checkpoint_every": checkpoint_every})


def shard_settings(settings: PodSettings) -> PodSettings:
    """The workers' settings with the shards' own cpu and memory (--ps-cpu, --ps-memory) where
    given, and no GPU: a shard computes nothing on one."""
    cpu, memory = settings.ps_cpu, settings.ps_memory
    return replace(settings, gpus=0, **({"cpu_request": cpu[0], "cpu_limit": cpu[1]} if cpu else {}),
                   **({"memory_request": memory[0], "memory_limit": memory[1]} if memory else {}))


def ps_pod(settings: PodSettings, names: JobNames, master: MasterPod | None, image: str, shard: int, config: str,
           restore: dict | None = None) -> k8s.V1Pod:
    """Shard `shard`'s pod: the workers' image, service account (no API rights, no token
    mounted), security context and requests (no GPU), restarted in place when it fails.
    `restore`: a resumed job's cut for it to wait for before it serves (ps_cuts.py)."""
    env = [
        k8s.V1EnvVar(name=POD_IP_ENV, value_from=k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(field_path="status.podIP"))),
        k8s.V1EnvVar(name=CONFIG_ENV, value=config),
        k8s.V1EnvVar(name=DIR_ENV, value=DATA_DIR),
        k8s.V1EnvVar(name=WorkerEnv.TOKEN_FILE.value, value=f"{TOKEN_MOUNT}/{TOKEN_KEY}"),
        k8s.V1EnvVar(name="HOME", value="/tmp"),  # the root filesystem is read-only
        k8s.V1EnvVar(name="OMP_NUM_THREADS", value="1"),
        *([k8s.V1EnvVar(name=RESTORE_ENV, value=json.dumps(restore))] if restore else []),
    ]
    command = ["python", "-m", "elastic_step.backends.kubernetes.ps_pods", "--shard", str(shard),
               "--host", f"$({POD_IP_ENV})", "--port", str(PS_PORT + shard)]
    container = k8s.V1Container(
        name="ps", image=image, command=command, env=env, resources=resources(shard_settings(settings)),
        ports=[k8s.V1ContainerPort(name="ps", container_port=PS_PORT + shard, protocol="TCP")],
        volume_mounts=[k8s.V1VolumeMount(name="token", mount_path=TOKEN_MOUNT, read_only=True),
                       k8s.V1VolumeMount(name="scratch", mount_path="/tmp")],
        security_context=restricted_container(),
    )
    spec = job_pod_spec(settings, names, container, volumes=[],
                        restart_policy="OnFailure")  # a dead shard comes back in the same pod: same address, same emptyDir
    labels = {**names.labels(COMPONENT), SHARD_LABEL: str(shard), ISTIO_INJECT_LABEL: "false"}  # no sidecar: workers connect directly
    return k8s.V1Pod(api_version="v1", kind="Pod", spec=spec,
                     metadata=k8s.V1ObjectMeta(name=ps_pod_name(names, shard), labels=labels,
                                               owner_references=owner_references(master, settings.namespace)))


def ps_network_policy(names: JobNames, master: MasterPod | None, namespace: str, master_labels: dict[str, str] | None,
                      shards: int = DEFAULT_VIRTUAL_SHARDS) -> k8s.V1NetworkPolicy:
    """The shards admit the job's workers and its master pod (stats, validation pulls, the last
    rows), on the shards' ports only: the range of as many as `shards` (the virtual shards, the
    most a scale --ps may run), so that a scale needs no change of the policy. The master is left
    out when its pod has no labels to select it by (the user's --no-master-network-policy): an
    empty selector would admit every pod."""
    ports = [k8s.V1NetworkPolicyPort(protocol="TCP", port=PS_PORT, end_port=PS_PORT + shards - 1)]
    peers = [k8s.V1NetworkPolicyPeer(pod_selector=k8s.V1LabelSelector(match_labels=names.worker_labels))]
    selector = master_selector(master_labels)
    if selector:
        peers.append(k8s.V1NetworkPolicyPeer(pod_selector=k8s.V1LabelSelector(match_labels=selector)))
    return k8s.V1NetworkPolicy(
        api_version="networking.k8s.io/v1", kind="NetworkPolicy",
        metadata=k8s.V1ObjectMeta(name=names.network_policy(COMPONENT), labels=names.labels("network-policy"),
                                  owner_references=owner_references(master, namespace)),
        spec=k8s.V1NetworkPolicySpec(pod_selector=k8s.V1LabelSelector(match_labels=ps_labels(names)), policy_types=["Ingress"],
                                     ingress=[k8s.V1NetworkPolicyIngressRule(_from=peers, ports=ports)]),
    )
