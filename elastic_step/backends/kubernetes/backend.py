"""Worker pods created by the master. The pod watch feeds the state table; `poll` turns the
table's verdicts into WorkerExits for the master, which decides about relaunching."""

from __future__ import annotations

import logging
import time

from kubernetes import client as k8s

from elastic_step.backends.api import Backend, LaunchSpec, WorkerExit
from elastic_step.backends.kubernetes import manifests
from elastic_step.backends.kubernetes.options import MasterPod, PodSettings, master_pod_from_env
from elastic_step.backends.kubernetes.pod_states import is_stuck_waiting, judge, read_facts
from elastic_step.backends.kubernetes.watch import PodWatcher
from elastic_step.errors import ConfigError
from elastic_step.images import default_image

log = logging.getLogger("elastic_step.backends.kubernetes")


def read_token(spec: LaunchSpec) -> str:
    with open(spec.token_file, encoding="utf-8") as f:
        return f.read().strip()


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
    ):
        from elastic_step.backends.kubernetes.client import load_core_api

        self.spec = spec
        self.settings = settings
        self.api = api if api is not None else load_core_api()
        self.master = master if master is not None else master_pod_from_env()
        self.names = manifests.JobNames.for_job(job_name)
        self.image = settings.image or self._own_image() or default_image()
        self.pods: dict[str, str] = {}  # worker id -> pod name, for workers not yet reported gone
        self.workers: dict[str, str] = {}  # pod name -> worker id
        self.last_seen: dict[str, k8s.V1Pod] = {}
        self.we_deleted: set[str] = set()
        self.stuck_since: dict[str, float] = {}
        self._pending_failures: list[WorkerExit] = []  # pods the API refused to create
        self.rules_matched: list[tuple[str, str]] = []  # (pod, table row): what the table decided, for status and tests
        self.watcher = PodWatcher(self.api, settings.namespace, self.names.selector, watch_timeout_s)
        self._create_secret()
        self.watcher.start()

    # -- set-up -----------------------------------------------------------------------------------
    def _own_image(self) -> str | None:
        """The master pod's own image: workers run the code the master runs."""
        if self.master is None:
            return None
        try:
            pod = self.api.read_namespaced_pod(self.master.name, self.settings.namespace)
        except k8s.ApiException as exc:
            log.warning("cannot read the master pod %s (%s); workers use the default image", self.master.name, exc.reason)
            return None
        if self.master.uid == "":
            self.master.uid = pod.metadata.uid
        return pod.spec.containers[0].image

    def _create_secret(self) -> None:
        secret = manifests.token_secret(self.names, self.master, read_token(self.spec))
        try:
            self.api.create_namespaced_secret(self.settings.namespace, secret)
        except k8s.ApiException as exc:
            raise ConfigError(
                f"cannot create the job's token Secret {self.names.secret} in namespace {self.settings.namespace}: "
                f"{exc.status} {exc.reason}; the master's service account needs the Role in deploy/rbac"
            ) from None

    def pod_manifest(self, slot: int, worker_id: str) -> k8s.V1Pod:
        return manifests.worker_pod(
            self.settings, self.names, self.master, self.image, worker_id, slot, self.spec.master_url, self.spec.env
        )

    # -- the Backend interface --------------------------------------------------------------------
    def launch(self, slot: int, worker_id: str) -> None:
        pod = self.pod_manifest(slot, worker_id)
        name = pod.metadata.name
        self.pods[worker_id], self.workers[name] = name, worker_id
        try:
            self.api.create_namespaced_pod(self.settings.namespace, pod)
        except k8s.ApiException as exc:
            # Reported as an exit at the next poll: the master's relaunch limit applies.
            log.warning("creating pod %s failed: %s %s", name, exc.status, exc.reason)
            self._pending_failures.append(WorkerExit(worker_id, f"pod {name} not created: {exc.status} {exc.reason}", None, "count"))

    def poll(self) -> list[WorkerExit]:
        exits, self._pending_failures = self._pending_failures, []
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
        if not deleted:
            self._delete_pod(name)  # a finished or failed pod frees its place (logs stay in the events)
        log.info("worker %s: %s (%s)", worker_id, verdict.reason, row)
        return WorkerExit(worker_id, verdict.reason, verdict.returncode, verdict.relaunch)

    def _delete_pod(self, name: str) -> None:
        self.we_deleted.add(name)
        try:
            self.api.delete_namespaced_pod(name, self.settings.namespace, grace_period_seconds=0)
        except k8s.ApiException as exc:
            if exc.status != 404:
                log.warning("deleting pod %s failed: %s %s", name, exc.status, exc.reason)

    def stop(self, worker_id: str) -> None:
        name = self.pods.get(worker_id)
        if name is not None:
            self._delete_pod(name)  # grace 0: a hung worker gets no say

    def shutdown(self, grace_s: float) -> None:
        """Wait up to `grace_s` for workers to finish, then delete every pod of this job and its Secret."""
        deadline = time.monotonic() + grace_s
        while self.pods and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.1)
        try:
            listed = self.api.list_namespaced_pod(self.settings.namespace, label_selector=self.names.selector)
            remaining = {p.metadata.name for p in listed.items}
        except k8s.ApiException:
            remaining = set()
        for name in remaining | set(self.pods.values()):
            self._delete_pod(name)
        self.pods.clear()
        try:
            self.api.delete_namespaced_secret(self.names.secret, self.settings.namespace)
        except k8s.ApiException as exc:
            if exc.status != 404:
                log.warning("deleting Secret %s failed: %s %s", self.names.secret, exc.status, exc.reason)
        self.watcher.stop()

    def describe(self, worker_id: str) -> dict:
        name = self.pods.get(worker_id)
        if name is None:
            return {}
        pod = self.last_seen.get(name)
        phase = pod.status.phase if pod is not None and pod.status else "Pending"
        node = pod.spec.node_name if pod is not None and pod.spec else None
        return {"pod": name, "phase": phase, **({"node": node} if node else {})}
