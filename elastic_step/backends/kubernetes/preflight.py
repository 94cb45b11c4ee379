"""The master's pre-flight on a cluster, before the backend creates anything: may this pod's
service account make every call the backend makes (rights.py), and, in a KFP task, the reads
KFP's launcher makes with the same account once the step has trained? One
SelfSubjectAccessReview per right (the API server's own RBAC evaluation answers, as `kubectl
auth can-i` asks it); whatever is missing is refused in one line naming the account, its
namespace and exactly the missing verbs and resources, so a run fails in seconds rather than
at its first write (or, for KFP's launcher, after training).

In a KFP task it also reads `kfp-launcher` (optional in KFP: without it the launcher uses
minio://mlpipeline/v2/artifacts) for the Secret the launcher will upload outputs with, and
refuses in one line when that Secret is missing. Only the object's metadata is fetched
(PartialObjectMetadata): the master never holds the store's keys. Of the launcher's provider
configuration only the provider's `default` credentials are read, not per-bucket overrides.

And MLflow's Secret (`missing_secret_env`): an MLflow variable the pod spec takes from a Secret
that this process lacks is refused in one line naming the Secret and key, unless the reference is
marked optional (KFP's `use_secret_as_env(..., optional=True)`, the compiled pipelines' own):
Kubernetes then starts the pod without the variable, which is what a run against an MLflow
without auth, its URI given as mlflow_uri, wants. A step left with no URI at all is refused by
tracking/handover.py; one left without its user meets MLflow's own 401.

`check_before_start` runs all of it before the job opens its MLflow run; the backend runs the
same checks again before it creates anything, whoever constructs it."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import yaml
from kubernetes import client as k8s

from elastic_step.backends.kubernetes.calls import REQUEST_TIMEOUT_S
from elastic_step.backends.kubernetes.rights import (KFP_DEFAULT_PIPELINE_ROOT, KFP_LAUNCHER_CONFIG, KFP_STORE_SECRET,
                                                     Right, kfp_rights, master_rights)
from elastic_step.errors import ConfigError

log = logging.getLogger("elastic_step.backends.kubernetes")

METADATA_ONLY = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json"


def is_kfp_task() -> bool:
    """KFP's compiler gives the task's container KFP_POD_NAME (the launcher's own identity)."""
    return bool(os.environ.get("KFP_POD_NAME"))


class CannotAsk(Exception):
    """The API server does not let this account ask what it may do (no system:basic-user)."""


class Preflight:
    """The checks, over the master's own connection (`api_client`) to the API server."""

    def __init__(self, api_client, timeout_s: float, authorization=None, authentication=None):
        self.api_client, self.timeout_s = api_client, timeout_s
        self.authorization = authorization or k8s.AuthorizationV1Api(api_client)
        self.authentication = authentication or k8s.AuthenticationV1Api(api_client)

    @classmethod
    def over(cls, api, timeout_s: float) -> "Preflight":
        """Over the connection of `api` (a CoreV1Api); a stand-in without one answers the reviews itself."""
        if hasattr(api, "api_client"):
            return cls(api.api_client, timeout_s)
        return cls(None, timeout_s, authorization=api, authentication=api)

    def check(self, namespace: str, pod_namespace: str, kfp_task: bool) -> None:
        """Raise ConfigError naming what is missing; return when everything is in place."""
        try:
            missing, store_secret = self.missing_rights(namespace, pod_namespace, kfp_task)
        except CannotAsk as exc:  # a cluster that withholds the reviews: the calls still say what fails
            log.warning("permission pre-flight skipped: the API server refused the review (%s)", exc)
            return
        if missing:
            raise ConfigError(self.missing_message(missing, namespace))
        if store_secret and not self.exists("secrets", pod_namespace, store_secret):
            raise ConfigError(
                f"the Secret {store_secret!r} that KFP's launcher uploads this task's outputs with is missing from "
                f"namespace {pod_namespace}: create it (KFP's installation makes {KFP_STORE_SECRET}), or name yours in "
                f"the {KFP_LAUNCHER_CONFIG} ConfigMap's providers")

    def missing_rights(self, namespace: str, pod_namespace: str, kfp_task: bool) -> tuple[list[tuple[Right, str]], str | None]:
        """(the rights not granted, with their namespace; the launcher's store Secret in a KFP task)."""
        wanted = [(right, namespace) for right in master_rights()]
        store_secret = None
        if kfp_task:  # the launcher's config says which Secret it reads, if this account may read it
            readable = self.allowed(kfp_rights(None)[0], pod_namespace)
            store_secret = self.launcher_store_secret(pod_namespace) if readable else KFP_STORE_SECRET
            wanted += [(right, pod_namespace) for right in kfp_rights(store_secret)]
        return [(right, ns) for right, ns in wanted if not self.allowed(right, ns)], store_secret

    def allowed(self, right: Right, namespace: str) -> bool:
        attributes = k8s.V1ResourceAttributes(namespace=namespace, verb=right.verb, group=right.group,
                                              resource=right.resource, name=right.name or None)
        review = k8s.V1SelfSubjectAccessReview(spec=k8s.V1SelfSubjectAccessReviewSpec(resource_attributes=attributes))
        try:
            answer = self.authorization.create_self_subject_access_review(review, _request_timeout=self.timeout_s)
        except k8s.ApiException as exc:
            if exc.status in (401, 403, 404):  # not allowed to ask, or not served (a stripped-down server)
                raise CannotAsk(f"{exc.status} {exc.reason}") from None
            raise ConfigError(f"cannot ask the API server what the master may do (SelfSubjectAccessReview): "
                              f"{exc.status} {exc.reason}") from None
        return bool(answer.status and answer.status.allowed)

    def who(self) -> str:
        """The account the master's token belongs to, in words (SelfSubjectReview)."""
        try:
            user = self.authentication.create_self_subject_review(
                k8s.V1SelfSubjectReview(), _request_timeout=self.timeout_s).status.user_info.username
        except Exception:  # an older API server: the message is still right without the name
            return "the master's service account"
        prefix = "system:serviceaccount:"
        if user.startswith(prefix) and user.count(":") == 3:
            namespace, name = user[len(prefix):].split(":")
            return f'the service account "{name}" of namespace {namespace}'
        return f'the user "{user}"'

    def missing_message(self, missing: list[tuple[Right, str]], namespace: str) -> str:
        groups: dict[tuple[str, str, str, str], list[str]] = {}
        for right, ns in missing:
            groups.setdefault((right.group, right.resource, right.name, ns), []).append(right.verb)
        parts = []
        for (group, resource, name, ns), verbs in groups.items():
            what = str(Right(", ".join(verbs), group, resource, name))
            parts.append(what + (f" (in namespace {ns})" if ns != namespace else ""))
        return (f"{self.who()} may not {'; '.join(parts)} in namespace {namespace}, all of which the master "
                "calls: bind it a Role that grants them (deploy/rbac for elastic-step-runner; deploy/kfp/single-user "
                "for KFP's pipeline-runner, deploy/kfp/multi-user for a Kubeflow profile's default-editor)")

    def launcher_store_secret(self, namespace: str) -> str | None:
        """The Secret KFP's launcher reads the artifact store's keys from, as its config says
        (kubeflow/pipelines backend/src/v2/config: minio.go, s3.go): KFP's own for a minio://
        root without providers; none when the provider takes them from the environment."""
        try:
            config = k8s.CoreV1Api(self.api_client).read_namespaced_config_map(
                KFP_LAUNCHER_CONFIG, namespace, _request_timeout=self.timeout_s).data or {}
        except k8s.ApiException as exc:
            if exc.status != 404:
                raise ConfigError(f"cannot read the {KFP_LAUNCHER_CONFIG} ConfigMap in namespace {namespace}: "
                                  f"{exc.status} {exc.reason}") from None
            config = {}  # optional in KFP: the launcher's defaults apply
        root = config.get("defaultPipelineRoot") or KFP_DEFAULT_PIPELINE_ROOT
        scheme = root.partition("://")[0]
        try:
            providers = yaml.safe_load(config.get("providers") or "") or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"the {KFP_LAUNCHER_CONFIG} ConfigMap's providers are not YAML: {exc}") from None
        provider = providers.get(scheme) or {}
        credentials = (provider.get("default") or {}).get("credentials") or {}
        if not provider:
            return KFP_STORE_SECRET if scheme == "minio" else None
        if credentials.get("fromEnv"):
            return None
        return (credentials.get("secretRef") or {}).get("secretName") or None

    def exists(self, plural: str, namespace: str, name: str) -> bool:
        """Whether the object is there, reading its metadata only."""
        try:
            self.api_client.call_api(f"/api/v1/namespaces/{namespace}/{plural}/{name}", "GET",
                                     header_params={"Accept": METADATA_ONLY}, auth_settings=["BearerToken"],
                                     response_type=None, _request_timeout=self.timeout_s)
        except k8s.ApiException as exc:
            if exc.status == 404:
                return False
            raise ConfigError(f"cannot look up {plural} {name!r} in namespace {namespace}: {exc.status} {exc.reason}") from None
        return True


def missing_secret_env(container: k8s.V1Container | None, environ: Mapping[str, str], namespace: str) -> None:
    """Refuse when an MLflow variable the pod spec requires from a Secret is absent from this
    process's environment; one from a Secret or key marked optional is only logged, as Kubernetes
    leaves such a variable unset by design (credentials are not needed everywhere)."""
    for env in (container.env or []) if container is not None else []:
        ref = env.value_from.secret_key_ref if env.value_from is not None else None
        if ref is None or not env.name.startswith("MLFLOW_") or env.name in environ:
            continue
        if ref.optional:
            log.info("%s is unset: its Secret %r (key %r), marked optional, is absent from namespace %s",
                     env.name, ref.name, ref.key, namespace)
            continue
        raise ConfigError(
            f"the Secret {ref.name!r} (key {ref.key!r}) that gives this pod {env.name} is missing from namespace "
            f"{namespace}: create it with the MLflow user's credentials (docs/kubernetes.md, MLflow on the cluster)")


def check_before_start(namespace: str) -> None:
    """The whole pre-flight of a master about to start `--backend kubernetes` in a pod, before it
    opens its MLflow run: its rights, KFP's launcher's, and its MLflow Secret."""
    from elastic_step.backends.kubernetes.client import load_core_api
    from elastic_step.backends.kubernetes.options import master_pod_from_env

    api = load_core_api()
    master = master_pod_from_env()
    pod_namespace = (master.namespace if master is not None else "") or namespace
    Preflight.over(api, REQUEST_TIMEOUT_S).check(namespace, pod_namespace, is_kfp_task())
    if master is None:
        return
    try:
        pod = api.read_namespaced_pod(master.name, pod_namespace, _request_timeout=REQUEST_TIMEOUT_S)
    except k8s.ApiException:
        return  # the backend says what it cannot do without its pod
    from elastic_step.backends.kubernetes.backend import main_container

    missing_secret_env(main_container(pod), os.environ, pod_namespace)
