"""Worker pods created by the master. The pod watch feeds the state table; `poll` turns the
table's verdicts into WorkerExits for the master, which decides about relaunching.

The master calls `launch`, `stop`, `poll` and `describe` while holding its lock, which its API
also waits on: none of them may wait for the API server. Creating and deleting pods happens on
the backend's own thread (`PodCalls`), so a stalled API server delays pods, never the master;
every call carries a request timeout, so a stalled call ends too."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Collection
from urllib.parse import urlparse

from kubernetes import client as k8s

from elastic_step.backends.api import Backend, LaunchSpec, WorkerExit
from elastic_step.backends.kubernetes import manifests
from elastic_step.backends.kubernetes.calls import REQUEST_TIMEOUT_S, PodCalls, delete_pod
from elastic_step.backends.kubernetes.isolation import master_policy_labels
from elastic_step.backends.kubernetes.options import MasterPod, PodSettings, master_pod_from_env, shared_mounts
from elastic_step.backends.kubernetes.pod_states import is_stuck_waiting, judge, read_facts
from elastic_step.backends.kubernetes.preflight import Preflight, is_kfp_task, missing_secret_env
from elastic_step.backends.kubernetes.rights import MASTER_CALLS, Guarded
from elastic_step.backends.kubernetes.store_access import worker_store_env
from elastic_step.backends.kubernetes.watch import PodWatcher
from elastic_step.errors import ConfigError
from elastic_step.images import default_image

log = logging.getLogger("elastic_step.backends.kubernetes")

LOOPBACK = ("127.0.0.1", "localhost", "0.0.0.0", "::1")


def read_token(spec: LaunchSpec) -> str:
    with open(spec.token_file, encoding="utf-8") as f:
        return f.read().strip()


def _requests(config_map: k8s.V1ConfigMap) -> dict[str, str]:
    """The operator's requests on the status ConfigMap (its annotations), by name."""
    annotations = (config_map.metadata.annotations or {}) if config_map.metadata else {}
    return {name: annotations[key] for name, key in manifests.REQUEST_ANNOTATIONS.items() if key in annotations}


def main_container(pod: k8s.V1Pod) -> k8s.V1Container | None:
    """The master's own container: `main` (Argo's and KFP's name for the step's container; Argo
    lists its `wait` sidecar first), else the pod's only container."""
    containers = pod.spec.containers or []
    named = [c for c in containers if c.name == "main"]
    if named:
        return named[0]
    return containers[0] if len(containers) == 1 else None


class KubernetesBackend(Backend):
    name = "kubernetes"

    def __init__(
        self,
        spec: LaunchSpec,
        settings: PodSettings,
        job_name: str,
        api=None,
        master: MasterPod | None = None,
        watch_timeout_s: int = 30,
        networking=None,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ):
        from elastic_step.backends.kubernetes.client import load_core_api

        self.spec = spec
        self.settings = settings
        raw = api if api is not None else load_core_api()
        # NetworkPolicies live in networking.k8s.io: the same connection, another API group.
        if networking is None:
            networking = k8s.NetworkingV1Api(raw.api_client) if hasattr(raw, "api_client") else raw
        # Every call goes through the table of declared rights (rights.py), which the pre-flight checks.
        self.api, self.networking = Guarded(raw, MASTER_CALLS), Guarded(networking, MASTER_CALLS)
        self.preflight = Preflight.over(raw, request_timeout_s)
        self.timeout_s = request_timeout_s
        self.master = master if master is not None else master_pod_from_env()
        self.pods: dict[str, str] = {}  # worker id -> pod name, for workers not yet reported gone
        self.workers: dict[str, str] = {}  # pod name -> worker id
        self.last_seen: dict[str, k8s.V1Pod] = {}
        self.we_deleted: set[str] = set()
        self.stuck_since: dict[str, float] = {}
        self._failures_lock = threading.Lock()
        self._pending_failures: list[WorkerExit] = []  # pods the API refused to create
        self.rules_matched: list[tuple[str, str]] = []  # (pod, table row): what the table decided, for status and tests
        self.network_policies: list[str] = []
        self.status_published = False  # the status ConfigMap exists (created by this master)
        self._publish_failing = False
        self._shut_down = False  # after shutdown nothing is published (it would outlive the job)
        self._check_reachable()
        self._check_permissions()
        own_pod = self._read_own_pod()
        self.names = manifests.JobNames.for_master(job_name, self.master, settings.namespace)  # its UID now known
        if own_pod is not None:  # a required MLflow Secret this process lacks: named now, not at the first call
            missing_secret_env(main_container(own_pod), os.environ, self.master.namespace)
        self.image = self._worker_image(own_pod)
        if own_pod is not None:  # requests not given: the step's own (a ResourceQuota requires them)
            self.settings = settings = manifests.with_own_requests(settings, main_container(own_pod))
        self._check_service_account(own_pod)
        self.master_labels = master_policy_labels(settings, self.master, own_pod)  # refused here unless opted out
        self.secret_env = self._store_credentials(own_pod)
        self.shared = manifests.shared_volumes_of(own_pod, main_container(own_pod) if own_pod is not None else None,
                                                  shared_mounts())
        if self.master is not None and not manifests.owns(self.master, settings.namespace):
            log.warning(
                "worker pods go to namespace %s, the master pod is in %s: no owner references across namespaces, so "
                "the master deletes its pods, Secret and NetworkPolicies itself when it ends; if it is killed "
                "outright, delete them with: kubectl delete pods,secrets,networkpolicies -n %s -l "
                "app.kubernetes.io/instance=%s", settings.namespace, self.master.namespace or "an unknown namespace",
                settings.namespace, self.names.instance)
        self.watcher = PodWatcher(self.api, settings.namespace, self.names.selector, watch_timeout_s,
                                  request_timeout_s=request_timeout_s)
        self._create_secret()
        self._create_network_policies()
        try:
            self.watcher.start()  # the first list, here: an API error surfaces before any worker
        except k8s.ApiException as exc:
            self._delete_made()
            raise ConfigError(
                f"cannot list pods in namespace {settings.namespace}: {exc.status} {exc.reason}; the master's service "
                "account needs the Role in deploy/rbac"
            ) from None
        self.calls = PodCalls(self.api, settings.namespace, request_timeout_s, self._create_failed)

    # -- set-up -----------------------------------------------------------------------------------
    def _check_reachable(self) -> None:
        """Workers in other pods cannot call a master on loopback (unless it is its pod's IP)."""
        host = urlparse(self.spec.master_url).hostname or ""
        if host in LOOPBACK and (self.master is None or self.master.ip != host):
            raise ConfigError(
                f"--backend kubernetes: worker pods cannot reach a master listening on {host}; run the master in a "
                "pod with ELASTIC_STEP_POD_IP set from the downward API (status.podIP), or pass --host with an "
                "address the pods can reach"
            )

    def _check_permissions(self) -> None:
        """Before anything is created: every right the backend's calls need (and, in a KFP task,
        the launcher's reads), asked of the API server (preflight.py)."""
        pod_namespace = (self.master.namespace if self.master is not None else "") or self.settings.namespace
        self.preflight.check(self.settings.namespace, pod_namespace, is_kfp_task())

    def _read_own_pod(self) -> k8s.V1Pod | None:
        """The master's pod object: its UID (when the downward API gave none), labels, service
        account and image. None outside a pod."""
        if self.master is None:
            return None
        namespace = self.master.namespace or self.settings.namespace
        try:
            pod = self.api.read_namespaced_pod(self.master.name, namespace, _request_timeout=self.timeout_s)
        except k8s.ApiException as exc:
            log.warning("cannot read the master pod %s in %s (%s %s)", self.master.name, namespace, exc.status, exc.reason)
            return None
        self.master.uid = self.master.uid or pod.metadata.uid
        self.master.namespace = self.master.namespace or pod.metadata.namespace or namespace
        return pod

    def _worker_image(self, own_pod: k8s.V1Pod | None) -> str:
        """--image, else ELASTIC_STEP_IMAGE, else the master pod's own `main` container: workers
        run the code the master runs. Outside a pod: the project image of this version."""
        if self.settings.image:
            return self.settings.image
        if os.environ.get("ELASTIC_STEP_IMAGE"):
            return os.environ["ELASTIC_STEP_IMAGE"]
        if self.master is None:
            return default_image()
        container = main_container(own_pod) if own_pod is not None else None
        if container is None or not container.image:
            found = "could not be read" if own_pod is None else (
                "has no container named main among " + ", ".join(c.name for c in own_pod.spec.containers or []))
            raise ConfigError(
                f"--backend kubernetes: the master pod {self.master.name} {found}, so the worker image is unknown; "
                "pass --image or set ELASTIC_STEP_IMAGE to the image workers run"
            )
        return container.image

    def _store_credentials(self, own_pod: k8s.V1Pod | None) -> list[k8s.V1EnvVar]:
        """Workers read the data themselves, with the keys store_access.py gives them (never KFP's
        whole-store Secret unless it is named)."""
        found = manifests.store_credentials_of(main_container(own_pod)) if own_pod is not None else []
        return worker_store_env(found, self.settings.worker_store_secret, self.master.namespace if found else "",
                                self.settings.namespace)

    def _check_service_account(self, own_pod: k8s.V1Pod | None) -> None:
        """Worker pods never run as the master: its service account may create pods and Secrets."""
        master_account = own_pod.spec.service_account_name if own_pod is not None and own_pod.spec else None
        if master_account and self.settings.service_account == master_account:
            raise ConfigError(
                f"--service-account {master_account} is the master's own service account, which may create pods and "
                "Secrets; give workers theirs (elastic-step-worker from deploy/rbac, the default)"
            )

    def _create_secret(self) -> None:
        secret = manifests.token_secret(self.names, self.master, read_token(self.spec), self.settings.namespace)
        try:
            self.api.create_namespaced_secret(self.settings.namespace, secret, _request_timeout=self.timeout_s)
        except k8s.ApiException as exc:
            if exc.status == 409:  # the instance is named after this pod: an earlier master in it left its objects
                raise ConfigError(
                    f"the job's token Secret {self.names.secret} is already in namespace {self.settings.namespace}: an "
                    "earlier master in this pod left its objects; delete them with: kubectl delete "
                    f"pods,secrets,networkpolicies,configmaps -n {self.settings.namespace} -l "
                    f"app.kubernetes.io/instance={self.names.instance}") from None
            raise ConfigError(
                f"cannot create the job's token Secret {self.names.secret} in namespace {self.settings.namespace}: "
                f"{exc.status} {exc.reason}; the master's service account needs the Role in deploy/rbac"
            ) from None

    def _create_network_policies(self) -> None:
        for policy in manifests.network_policies(self.names, self.master, self.settings.namespace, self.master_labels,
                                                 self.spec.master_ports or None):
            try:
                self.networking.create_namespaced_network_policy(self.settings.namespace, policy,
                                                                 _request_timeout=self.timeout_s)
            except k8s.ApiException as exc:
                self._delete_made()
                raise ConfigError(
                    f"cannot create the job's NetworkPolicy {policy.metadata.name} in namespace "
                    f"{self.settings.namespace}: {exc.status} {exc.reason}; the master's service account needs the "
                    "Role in deploy/rbac"
                ) from None
            self.network_policies.append(policy.metadata.name)

    def pod_manifest(self, slot: int, worker_id: str) -> k8s.V1Pod:
        return manifests.worker_pod(
            self.settings, self.names, self.master, self.image, worker_id, slot, self.spec.master_url, self.spec.env,
            self.secret_env, self.shared,
        )

    def shard_launcher(self):
        """A --mode ps job's shards are pods of the job too (ps_pods.py)."""
        from elastic_step.backends.kubernetes.ps_pods import PsPods

        return PsPods(self)

    def _create_failed(self, worker_id: str, reason: str) -> None:
        with self._failures_lock:
            self._pending_failures.append(WorkerExit(worker_id, reason, None, "count"))

    # -- the Backend interface (called under the master's lock: nothing here waits for the API) ---
    def launch(self, slot: int, worker_id: str) -> None:
        pod = self.pod_manifest(slot, worker_id)
        name = pod.metadata.name
        self.pods[worker_id], self.workers[name] = name, worker_id
        self.calls.create(pod, worker_id)

    def poll(self) -> list[WorkerExit]:
        with self._failures_lock:
            failed, self._pending_failures = self._pending_failures, []
        exits = []
        for exit_ in failed:
            name = self.pods.get(exit_.worker_id)
            if name is not None:
                del self.pods[exit_.worker_id]
                self.stuck_since.pop(name, None)
                exits.append(exit_)
        for kind, pod in self.watcher.drain():
            name = pod.metadata.name
            if name in self.workers:
                self.last_seen[name] = pod
                exit_ = self._apply(name, pod, deleted=kind == "DELETED")
                if exit_ is not None:
                    exits.append(exit_)
        # Stuck pods time out without any new event: look again at the last status seen.
        for name in [n for n in self.stuck_since if n in self.last_seen]:
            exit_ = self._apply(name, self.last_seen[name], deleted=False)
            if exit_ is not None:
                exits.append(exit_)
        return exits

    def _apply(self, name: str, pod: k8s.V1Pod, deleted: bool) -> WorkerExit | None:
        worker_id = self.workers[name]
        if self.pods.get(worker_id) != name:
            return None  # already reported gone: later events are its clean-up
        now = time.monotonic()
        facts = read_facts(pod, deleted=deleted, we_deleted=name in self.we_deleted,
                           pending_s=now - self.stuck_since.get(name, now), pending_timeout_s=self.settings.pending_timeout_s)
        if is_stuck_waiting(facts) and not deleted:
            self.stuck_since.setdefault(name, now)
        else:
            self.stuck_since.pop(name, None)
        row, verdict = judge(facts)
        if verdict.state != "gone":
            return None
        self.rules_matched.append((name, row))
        del self.pods[worker_id]
        self.stuck_since.pop(name, None)
        if not deleted and not facts.deleting:
            # A finished or failed pod frees its place (logs stay in the events). One being
            # deleted already is left to that delete: its container has ended (pod_states.py).
            self._delete_pod(name)
        log.info("worker %s: %s (%s)", worker_id, verdict.reason, row)
        return WorkerExit(worker_id, verdict.reason, verdict.returncode, verdict.relaunch, left=verdict.left)

    def _delete_pod(self, name: str) -> None:
        self.we_deleted.add(name)
        self.calls.delete(name)

    def stop(self, worker_id: str) -> None:
        name = self.pods.get(worker_id)
        if name is not None:
            self._delete_pod(name)  # grace 0: a hung worker gets no say

    def shutdown(self, grace_s: float, members: Collection[str] | None = None) -> None:
        """Wait up to `grace_s` for `members` (every worker when None) to finish, then delete
        every pod of this job, its Secret and its NetworkPolicies (here, not only through owner
        references: the master may not own them, and a finished master pod is kept by Argo and KFP).
        Pods of other workers (still starting, spares) are deleted at once."""
        self._shut_down = True
        deadline = time.monotonic() + grace_s
        if members is not None:
            for worker_id in [w for w in self.pods if w not in members]:
                self.stop(worker_id)
        while any(members is None or w in members for w in self.pods) and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.1)
        self.calls.wait_idle(self.timeout_s)
        self.calls.close(self.timeout_s)
        try:
            listed = self.api.list_namespaced_pod(self.settings.namespace, label_selector=self.names.selector,
                                                  _request_timeout=self.timeout_s)
            remaining = {p.metadata.name for p in listed.items}
        except Exception as exc:
            log.warning("listing the job's pods failed (%s); deleting the ones it knows", exc)
            remaining = set()
        for name in remaining | set(self.pods.values()):
            self.we_deleted.add(name)
            delete_pod(self.api, name, self.settings.namespace, self.timeout_s)
        self.pods.clear()
        self._delete_made()
        self.watcher.stop()

    # -- the status others read ---------------------------------------------------------------------
    publishes_status = True

    def publish(self, document: dict) -> dict[str, str]:
        """Create, then update, the job's status ConfigMap (`elastic-step get|top|stop --backend
        kubernetes` read it with their own credentials); a stop request is its annotation. A
        failing API costs a warning (once per outage) and stale status, never the job."""
        import json

        ns, text = self.settings.namespace, json.dumps(document, default=str)
        if self._shut_down:
            return {}
        try:
            if self.status_published:
                reply = self.api.patch_namespaced_config_map(self.names.status_map, ns, {"data": {manifests.STATUS_KEY: text}},
                                                             _request_timeout=self.timeout_s)
            else:
                reply = self.api.create_namespaced_config_map(ns, manifests.status_map(self.names, self.master, ns, text),
                                                              _request_timeout=self.timeout_s)
                self.status_published = True
        except Exception as exc:
            if getattr(exc, "status", None) == 409:
                return self._replace_found_status_map()
            if not self._publish_failing:
                log.warning("cannot update the job's status ConfigMap %s in %s (%s): `elastic-step get --backend "
                            "kubernetes` shows older status until it works again", self.names.status_map, ns,
                            getattr(exc, "reason", None) or exc)
            self._publish_failing = True
            return self._requested_anyway() if self.status_published else {}
        self._publish_failing = False
        return _requests(reply)

    def _replace_found_status_map(self) -> dict[str, str]:
        """A ConfigMap of this instance's status name was there before this master made one: an
        earlier create whose reply was lost, or one planted (the instance shows in the job's
        Secret as soon as it is made) with owners and annotations of its maker's choosing. Which,
        nothing in it can prove, so it is deleted and made afresh at the next publish: the job's
        status is only ever in an object this master created."""
        log.warning("a ConfigMap %s was there before this master made it: replaced", self.names.status_map)
        self._delete_status_map()
        return {}

    def _delete_status_map(self) -> None:
        try:
            self.api.delete_namespaced_config_map(self.names.status_map, self.settings.namespace,
                                                  _request_timeout=self.timeout_s)
        except Exception as exc:
            if getattr(exc, "status", None) != 404:  # already gone is what was asked
                log.warning("deleting ConfigMap %s failed: %s", self.names.status_map, exc)

    def _requested_anyway(self) -> dict[str, str]:
        """The update failed, but the operator's requests must still be read: an empty patch
        changes nothing and answers the ConfigMap as it is (the Role grants patch, not get)."""
        try:
            reply = self.api.patch_namespaced_config_map(self.names.status_map, self.settings.namespace, {},
                                                         _request_timeout=self.timeout_s)
        except Exception:
            return {}
        return _requests(reply)

    def _delete_made(self) -> None:
        """The job's Secret, NetworkPolicies and status ConfigMap."""
        self._delete_secret()
        if self.status_published:
            self._delete_status_map()
            self.status_published = False
        for name in self.network_policies:
            try:
                self.networking.delete_namespaced_network_policy(name, self.settings.namespace,
                                                                 _request_timeout=self.timeout_s)
            except Exception as exc:
                if getattr(exc, "status", None) != 404:
                    log.warning("deleting NetworkPolicy %s failed: %s", name, exc)
        self.network_policies = []

    def _delete_secret(self) -> None:
        try:
            self.api.delete_namespaced_secret(self.names.secret, self.settings.namespace, _request_timeout=self.timeout_s)
        except Exception as exc:  # an API error or a timeout: the rest of the clean-up still runs
            if getattr(exc, "status", None) != 404:
                log.warning("deleting Secret %s failed: %s", self.names.secret, exc)

    def describe(self, worker_id: str) -> dict:
        name = self.pods.get(worker_id)
        if name is None:
            return {}
        pod = self.last_seen.get(name)
        phase = pod.status.phase if pod is not None and pod.status else "Pending"
        node = pod.spec.node_name if pod is not None and pod.spec else None
        return {"pod": name, "phase": phase, **({"node": node} if node else {})}
