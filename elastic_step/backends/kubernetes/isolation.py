"""Whether the master pod can be closed to everyone but its own workers, decided before the backend
creates anything.

The master's port serves its API and, once a round forms, the rendezvous store, which takes no
token: only a NetworkPolicy that selects the master pod keeps the rest of the cluster off it.
That policy needs the master pod's labels, read from the pod object, in the namespace its workers
run in (a policy admits peers of its own namespace by pod labels alone). Where it cannot be made
the job does not start, unless the user opted out explicitly (`--no-master-network-policy`: a
cluster that enforces no NetworkPolicies, or a master isolated by other means), and then it says
so in the log."""

from __future__ import annotations

import logging

from kubernetes import client as k8s

from elastic_step.backends.kubernetes.manifests import master_selector
from elastic_step.backends.kubernetes.options import MasterPod, PodSettings
from elastic_step.errors import ConfigError

log = logging.getLogger("elastic_step.backends.kubernetes")

OPT_OUT = "--no-master-network-policy"


def why_no_master_policy(master: MasterPod | None, own_pod: k8s.V1Pod | None, namespace: str) -> str | None:
    """Why the master's NetworkPolicy cannot be made, with what to do; None when it can."""
    if master is None:
        return ("the master runs outside a pod (no ELASTIC_STEP_POD_NAME), so no policy can select it: run it in a "
                "pod with the downward API's env (deploy/examples)")
    if own_pod is None:
        return (f"its pod {master.name} could not be read in namespace {master.namespace or namespace}: grant the "
                "master's service account `get` on pods (deploy/rbac's Role)")
    if master.namespace != namespace:
        return (f"worker pods go to namespace {namespace} and the master pod is in {master.namespace}: run them in the "
                "master's namespace (drop --namespace)")
    if not master_selector(own_pod.metadata.labels if own_pod.metadata else None):
        return (f"its pod {master.name} has no labels to select it by: label the step pod (Argo's podMetadata, KFP's "
                "kubernetes.add_pod_label)")
    return None


def master_policy_labels(settings: PodSettings, master: MasterPod | None, own_pod: k8s.V1Pod | None) -> dict | None:
    """The master pod's labels for its NetworkPolicy. Raises ConfigError, in one line, when no
    policy can be made and the user did not opt out; None (and a warning) when they did."""
    reason = why_no_master_policy(master, own_pod, settings.namespace)
    if reason is None:
        return own_pod.metadata.labels
    if settings.master_network_policy:
        raise ConfigError(
            f"--backend kubernetes: the master's NetworkPolicy cannot be made, and without it any pod of the cluster "
            f"reaches the master's API and its unauthenticated rendezvous store: {reason}; or pass {OPT_OUT} where the "
            "cluster enforces no NetworkPolicies or the master pod is isolated otherwise")
    log.warning("%s: the master pod is open to every pod of the cluster (%s)", OPT_OUT, reason.partition(":")[0])
    return None
