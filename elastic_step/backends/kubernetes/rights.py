"""What the master asks of the API server, in one table: every client method the backend calls,
with the RBAC rights it needs. The backend reaches the API only through `Guarded`, which lets
through the methods of this table and no other, so a call cannot be added without its right;
the pre-flight (preflight.py) asks the API server for exactly these rights, and the tests hold
deploy/rbac's Role and deploy/kfp's overlays to them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Right:
    """One RBAC permission: a verb on a resource of an API group, optionally on one object."""

    verb: str
    group: str  # "" for the core group
    resource: str
    name: str = ""  # a rule's resourceNames: only this object

    def __str__(self) -> str:
        what = f"{self.group}/{self.resource}" if self.group else self.resource
        return f'{self.verb} {what}{f" {self.name!r}" if self.name else ""}'


def _core(resource: str, *verbs: str) -> tuple[Right, ...]:
    return tuple(Right(verb, "", resource) for verb in verbs)


NETWORKING = "networking.k8s.io"

# client method -> the rights one call of it needs (`list_namespaced_pod` also watches: watch=True)
MASTER_CALLS: dict[str, tuple[Right, ...]] = {
    "read_namespaced_pod": _core("pods", "get"),  # its own pod: image, UID, labels, service account
    "list_namespaced_pod": _core("pods", "list", "watch"),
    "create_namespaced_pod": _core("pods", "create"),
    "delete_namespaced_pod": _core("pods", "delete"),
    "create_namespaced_secret": _core("secrets", "create"),  # the job token
    "delete_namespaced_secret": _core("secrets", "delete"),
    "create_namespaced_config_map": _core("configmaps", "create"),  # the job's status
    "patch_namespaced_config_map": _core("configmaps", "patch"),
    "delete_namespaced_config_map": _core("configmaps", "delete"),
    "create_namespaced_network_policy": (Right("create", NETWORKING, "networkpolicies"),),
    "delete_namespaced_network_policy": (Right("delete", NETWORKING, "networkpolicies"),),
}

# What KFP's driver and launcher read with the task pod's own token (kubeflow/pipelines
# backend/src/v2/config/env.go): the launcher's configuration and the artifact store's keys.
KFP_LAUNCHER_CONFIG = "kfp-launcher"
KFP_STORE_SECRET = "mlpipeline-minio-artifact"  # the default when kfp-launcher names no other
KFP_DEFAULT_PIPELINE_ROOT = "minio://mlpipeline/v2/artifacts"


def kfp_rights(store_secret: str | None) -> tuple[Right, ...]:
    """The reads of a KFP task's driver and launcher (the same service account as the master)."""
    rights = (Right("get", "", "configmaps", KFP_LAUNCHER_CONFIG),)
    return rights + ((Right("get", "", "secrets", store_secret),) if store_secret else ())


def master_rights() -> tuple[Right, ...]:
    """Every right the backend's calls need, sorted: what deploy/rbac's Role grants."""
    return tuple(sorted({right for rights in MASTER_CALLS.values() for right in rights}))


class Guarded:
    """An API client that answers only the methods of `calls`: the backend's calls and its
    declared rights cannot drift apart (an undeclared call fails in every test that makes it)."""

    def __init__(self, api, calls: dict[str, tuple[Right, ...]]):
        self._api, self._calls = api, calls

    def __getattr__(self, name: str):
        if name not in self._calls:
            raise AttributeError(f"{name} is not among the master's declared calls "
                                 "(elastic_step/backends/kubernetes/rights.py): declare it with the right it needs")
        return getattr(self._api, name)

# The reviews the pre-flight asks with: every authenticated user may make them (Kubernetes'
# bootstrap ClusterRole `system:basic-user`), so no Role of ours grants them.
SELF_REVIEWS = (Right("create", "authorization.k8s.io", "selfsubjectaccessreviews"),
                Right("create", "authentication.k8s.io", "selfsubjectreviews"))
