"""What must hold before `submit` creates anything. Each check raises ConfigError (one line, exit
2) naming what is missing and what to do; a check the caller's own rights do not allow (a 403
on a read) is not a refusal: it is said on stderr and the API server judges the pod itself.

Local checks (no cluster): the job's name, where the data and the master's files are, the model
file's size. Cluster checks, with the caller's kubeconfig: the job does not exist yet, deploy/'s
service accounts are in the namespace and the master's is granted deploy/rbac's Role (asked as a
LocalSubjectAccessReview, which a namespace's admins may create), the named Secrets hold their
keys, the PriorityClass exists."""

from __future__ import annotations

import os
import re
import sys
from urllib.parse import urlsplit

from kubernetes import client as k8s

from elastic_step.data.stores import is_local
from elastic_step.errors import ConfigError
from elastic_step.submit.spec import CONFIG_MAP_LIMIT, MASTER_SERVICE_ACCOUNT, MLFLOW_KEYS, SCRATCH, STORE_KEYS, Submission

JOB_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?")  # a DNS label the master keeps as it is (40 at most)


def check_job_name(name: str) -> None:
    if not JOB_NAME.fullmatch(name or ""):
        raise ConfigError(f"--job-name {name!r} is not a DNS label of at most 40 characters (lower-case letters, digits "
                          "and '-', starting and ending alphanumeric), e.g. digits-1")


def check_model_file(path: str) -> None:
    size = os.path.getsize(path)
    if size > CONFIG_MAP_LIMIT:
        raise ConfigError(f"--model-def {path} is {size} bytes, over a ConfigMap's 1 MiB ({CONFIG_MAP_LIMIT} bytes); "
                          "build it into the image (FROM the elastic-step image) and pass its module name")


def under(path: str, folders: list[str]) -> bool:
    path = os.path.normpath(path)
    return any(path == f or path.startswith(f.rstrip("/") + "/") for f in folders)


def check_data(data: str, mounts: list[str]) -> None:
    """Workers read the data themselves: an object store, or a volume mounted in every pod."""
    if is_local(data) and not under(data.removeprefix("file://"), mounts):
        raise ConfigError(f"--data {data!r} is a path on this machine, which the job's pods cannot read; upload it to "
                          "an object store (s3://, gs://) or pass a path under a --volume's mount_path "
                          "(e.g. --volume claim=training-data,mount_path=/data --data /data/digits)")


def check_store_secret(data: str, secret: str | None) -> None:
    """The store Secret's keys are S3's (STORE_KEYS); gcsfs reads GCS with none of them. A GCS
    key file (GOOGLE_APPLICATION_CREDENTIALS) would not reach the worker pods either: GCS access
    is the pods' service accounts' own, by workload identity."""
    if secret and urlsplit(data or "").scheme in ("gs", "gcs"):
        raise ConfigError(f"--store-secret {secret}: its keys ({', '.join(STORE_KEYS)}) are S3's, and --data {data!r} "
                          "is on GCS, which reads none of them; drop --store-secret and give GCS access by workload "
                          "identity to service account elastic-step-runner (the master) and the workers' "
                          "(elastic-step-worker, or --service-account NAME)")


def check_pod_path(option: str, path: str | None) -> None:
    """A file the master writes must be on its scratch volume: its root filesystem is read-only."""
    if path and not under(path, [SCRATCH]):
        raise ConfigError(f"{option} {path!r} is not on the master pod's scratch volume; pass a path under {SCRATCH}/ "
                          f"(e.g. {SCRATCH}/audit.jsonl), or read the job with `elastic-step get`")


def check_mlflow_uri(uri: str | None) -> None:
    if uri and urlsplit(uri).password:
        raise ConfigError("--mlflow-uri holds a password, which would be readable in the pod's spec; pass the URI "
                          "without it and the user in a Secret with --mlflow-secret NAME (keys username, password)")


# -- on the cluster -------------------------------------------------------------------------------
def _status(exc: Exception) -> int | None:
    return getattr(exc, "status", None)


def _cannot_check(what: str, exc: Exception) -> None:
    print(f"elastic-step submit: cannot check {what} ({_status(exc)} {getattr(exc, 'reason', exc)}); "
          "going on, the API server judges the pod", file=sys.stderr)


def check_job_absent(api: k8s.CoreV1Api, sub: Submission) -> None:
    try:
        api.read_namespaced_pod(sub.pod_name, sub.namespace)
    except k8s.ApiException as exc:
        return None if exc.status == 404 else _cannot_check(f"whether job {sub.job} exists", exc)
    raise ConfigError(f"job {sub.job} already exists in namespace {sub.namespace} (pod {sub.pod_name}); choose another "
                      f"--job-name, or remove it with `elastic-step delete {sub.job} --namespace {sub.namespace}`")


def check_service_accounts(api: k8s.CoreV1Api, sub: Submission) -> None:
    for account in (MASTER_SERVICE_ACCOUNT, sub.worker_service_account):
        try:
            api.read_namespaced_service_account(account, sub.namespace)
        except k8s.ApiException as exc:
            if exc.status != 404:
                _cannot_check(f"service account {account}", exc)
                continue
            raise ConfigError(f"namespace {sub.namespace} has no service account {account}: apply deploy/ there first "
                              f"(kubectl apply -k deploy/ with its namespace set to {sub.namespace})") from None


def check_master_role(authorization: k8s.AuthorizationV1Api, sub: Submission) -> None:
    """The master's service account holds every right its backend calls for (deploy/rbac's Role)."""
    from elastic_step.backends.kubernetes.rights import master_rights

    user = f"system:serviceaccount:{sub.namespace}:{MASTER_SERVICE_ACCOUNT}"
    groups = ["system:serviceaccounts", f"system:serviceaccounts:{sub.namespace}", "system:authenticated"]
    denied = []
    for right in master_rights():
        attributes = k8s.V1ResourceAttributes(namespace=sub.namespace, verb=right.verb, group=right.group,
                                              resource=right.resource, name=right.name or None)
        review = k8s.V1LocalSubjectAccessReview(
            metadata=k8s.V1ObjectMeta(namespace=sub.namespace),
            spec=k8s.V1SubjectAccessReviewSpec(user=user, groups=groups, resource_attributes=attributes))
        try:
            answer = authorization.create_namespaced_local_subject_access_review(sub.namespace, review)
        except k8s.ApiException as exc:
            return _cannot_check(f"the Role of service account {MASTER_SERVICE_ACCOUNT}", exc)
        if not answer.status.allowed:
            denied.append(str(right))
    if denied:
        raise ConfigError(f"service account {MASTER_SERVICE_ACCOUNT} in namespace {sub.namespace} may not "
                          f"{', '.join(denied)}: bind it to deploy/rbac's Role there first (kubectl apply -k deploy/ "
                          f"with its namespace set to {sub.namespace})")


def check_secret(api: k8s.CoreV1Api, namespace: str, option: str, name: str, keys: tuple[str, ...] = ()) -> None:
    try:
        secret = api.read_namespaced_secret(name, namespace)
    except k8s.ApiException as exc:
        if exc.status != 404:
            return _cannot_check(f"Secret {name}", exc)
        example = " ".join(f"--from-literal={k}=..." for k in keys)
        raise ConfigError(f"{option} {name}: no such Secret in namespace {namespace}; create it first"
                          + (f" (kubectl create secret generic {name} -n {namespace} {example})" if keys else "")) from None
    missing = [k for k in keys if k not in (secret.data or {})]
    if missing:
        raise ConfigError(f"{option} {name}: the Secret in namespace {namespace} lacks key {', '.join(missing)} "
                          f"(it needs {', '.join(keys)})")


def check_priority_class(scheduling: k8s.SchedulingV1Api, name: str) -> None:
    try:
        scheduling.read_priority_class(name)
    except k8s.ApiException as exc:
        if exc.status != 404:
            return _cannot_check(f"PriorityClass {name}", exc)
        raise ConfigError(f"--priority-class {name}: no such PriorityClass in the cluster (kubectl get priorityclasses "
                          "lists them)") from None


def check_cluster(api_client, sub: Submission) -> None:
    """Every cluster check, before anything is created."""
    core = k8s.CoreV1Api(api_client)
    check_job_absent(core, sub)
    check_service_accounts(core, sub)
    check_master_role(k8s.AuthorizationV1Api(api_client), sub)
    for option, name, keys in (("--store-secret", sub.store_secret, STORE_KEYS),
                               ("--mlflow-secret", sub.mlflow_secret, MLFLOW_KEYS + (() if sub.mlflow_uri else ("uri",)))):
        if name:
            check_secret(core, sub.namespace, option, name, keys)
    for name in sub.image_pull_secrets:
        check_secret(core, sub.namespace, "--image-pull-secret", name)
    if sub.priority_class:
        check_priority_class(k8s.SchedulingV1Api(api_client), sub.priority_class)
