"""Which keys to the data store worker pods hold: never KFP's whole-store Secret by default.

Workers read their shards themselves, so they need the store's keys, by reference to a Secret
(never as values in a pod spec, which `pods get` shows). The master's own container may take its
keys from KFP's `mlpipeline-minio-artifact` (the shipped KFP pipelines do: KFP's launcher needs
them anyway), but those keys read and write every pipeline's artifacts, and worker pods run user
code. So:
- `--store-secret NAME` (train's old spelling --worker-store-secret; or ELASTIC_STEP_WORKER_STORE_SECRET, which a KFP task can set):
  workers take AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY from that Secret, made with read-only
  keys for the dataset (docs/kubernetes.md, "A read-only Secret for the data"). Naming KFP's own
  Secret there is the explicit way to accept its keys.
- Nothing named and the master's keys come from KFP's Secret: workers take the default
  per-dataset Secret `elastic-step-data-reader` instead, and the master says so.
- Otherwise workers take the same Secret references as the master's container (a Secret the user
  made for this data: Argo's and submit's --store-secret)."""

from __future__ import annotations

import logging
import re

from kubernetes import client as k8s

from elastic_step.backends.kubernetes.rights import KFP_STORE_SECRET
from elastic_step.errors import ConfigError

log = logging.getLogger("elastic_step.backends.kubernetes")

WORKER_STORE_SECRET_ENV = "ELASTIC_STEP_WORKER_STORE_SECRET"
DEFAULT_WORKER_STORE_SECRET = "elastic-step-data-reader"  # what the shipped KFP pipelines' workers read with
STORE_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")  # the keys of a Secret named for workers
KFP_KEYS = {"AWS_ACCESS_KEY_ID": "accesskey", "AWS_SECRET_ACCESS_KEY": "secretkey"}  # KFP's own Secret's
SECRET_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")  # a DNS-1123 subdomain


def check_secret_name(name: str | None) -> str | None:
    if name is not None and not SECRET_NAME.match(name):
        raise ConfigError(f"--store-secret {name!r} is not a Secret name (lower-case letters, digits, '-' and "
                          "'.'; e.g. elastic-step-data-reader)")
    return name


def secret_env(secret: str) -> list[k8s.V1EnvVar]:
    """The store's keys from `secret`, by reference (KFP's own Secret names its keys its way)."""
    keys = KFP_KEYS if secret == KFP_STORE_SECRET else {k: k for k in STORE_KEYS}
    return [k8s.V1EnvVar(name=var, value_from=k8s.V1EnvVarSource(
        secret_key_ref=k8s.V1SecretKeySelector(name=secret, key=key))) for var, key in keys.items()]


def worker_store_env(master_refs: list[k8s.V1EnvVar], named: str | None, master_namespace: str,
                     namespace: str) -> list[k8s.V1EnvVar]:
    """The store credentials of worker pods in `namespace`: `named`'s keys, else the master's
    references unless they are KFP's whole-store Secret's (then the default per-dataset Secret's).
    A Secret is only visible in its own namespace: the master's are no use to workers elsewhere."""
    if named:
        return secret_env(named)
    if master_refs and master_namespace != namespace:
        log.warning("worker pods in namespace %s cannot use the master's Secrets in %s: %s not given to them",
                    namespace, master_namespace, ", ".join(e.name for e in master_refs))
        return []
    if any(e.value_from.secret_key_ref.name == KFP_STORE_SECRET for e in master_refs):
        log.warning("worker pods read the data with the keys of the Secret %s, not those of KFP's %s (which read and "
                    "write every pipeline's artifacts): create it with read-only keys for this dataset "
                    "(docs/kubernetes.md), or name another with --store-secret or %s",
                    DEFAULT_WORKER_STORE_SECRET, KFP_STORE_SECRET, WORKER_STORE_SECRET_ENV)
        return secret_env(DEFAULT_WORKER_STORE_SECRET)
    return master_refs
