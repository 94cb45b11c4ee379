"""Watching a `--mode ps` job's shard pods from the master (ps_pods.py's design): a restarted
container, a deleted pod, a checkpoint's cut copied out of the pods, and the rollback of every
shard to a checkpoint when a pod and its rows are lost."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from typing import TYPE_CHECKING

from kubernetes import client as k8s

from elastic_step.backends.kubernetes.ps_cuts import CutStore, fetch_cut, part_name
from elastic_step.backends.kubernetes.ps_manifests import ps_pod_name
from elastic_step.backends.kubernetes.ps_pod_shards import PodShard, PodShards, asked
from elastic_step.protocol import PsShardState
from elastic_step.ps.api import PsError
from elastic_step.ps.client import PsClient
from elastic_step.ps.cuts import PARTS, files_digest
from elastic_step.ps.routing import RoutingTable

if TYPE_CHECKING:
    from elastic_step.backends.kubernetes.ps_pods import PsPods

log = logging.getLogger("elastic_step.backends.kubernetes")


def _container_restarts(pod: k8s.V1Pod) -> tuple[int, bool]:
    """(the shard container's restarts, whether it runs now)."""
    for status in (pod.status.container_statuses or []) if pod.status else []:
        if status.name == "ps":
            return int(status.restart_count or 0), bool(status.state and status.state.running)
    return 0, False


class PodSupervisor:
    """Watches the shard pods (ShardSupervisor's attributes, for ShardMonitor): a container the
    kubelet restarted is RELAUNCHING until its shard answers again (snapshot loaded, ledger
    replayed), then SERVING; a pod that ended or is gone took its emptyDir, so its rows, with it:
    the job goes back to its newest checkpoint (`lost`, roll_back), that shard in a new pod, or
    with none the shard is DOWN for good."""

    POLL_S = 0.5
    CUT_TIMEOUT_S = 120.0

    def __init__(self, launcher: PsPods, shards: PodShards, client: PsClient, store: CutStore | None = None):
        self.launcher, self.shards, self.client = launcher, shards, client
        self.store = store  # where each checkpoint's cut goes (the run's artifacts); None: nowhere
        self.ports = [s.port for s in shards.shards]
        self.states = [PsShardState.SERVING for _ in shards.shards]
        self.relaunches = [0 for _ in shards.shards]
        self.seen_restarts = [0 for _ in shards.shards]
        self.since = [0.0 for _ in shards.shards]
        # `lost(shard)`: the job goes back to its newest checkpoint (master/ps_rollback.py); True
        # when it does, False when it cannot (no checkpoint yet, or it failed): the shard is DOWN then.
        self.lost = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="ps-pods", daemon=True)

    def start(self) -> PodSupervisor:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()

    def resized(self) -> None:
        """Follow the shards' list after a scale --ps: the added ones serve, the removed ones gone."""
        count = len(self.shards.shards)
        self.ports = [s.port for s in self.shards.shards]
        self.states = (self.states + [PsShardState.SERVING] * count)[:count]
        self.relaunches = (self.relaunches + [0] * count)[:count]
        self.seen_restarts = (self.seen_restarts + [0] * count)[:count]
        self.since = (self.since + [0.0] * count)[:count]

    def keep_cut(self, cut: dict) -> None:
        """Before a checkpoint is recorded: every shard's cut of its step, copied from the pods
        (their folders go with them) and queued for the checkpoint store ahead of the checkpoint
        (ps_cuts.py). PsError or OSError when a shard's cannot be had: no checkpoint then."""
        if self.store is None:
            return
        step = int(cut["step"])
        folder = self.store.folder(step)
        client = PsClient(self.client.token, lambda: None, timeout_s=self.CUT_TIMEOUT_S)
        try:
            for shard, digest in zip(self.shards.shards, cut["digests"], strict=True):
                fetch_cut(client, shard.endpoint, step, folder, shard.shard, digest)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)  # no half of a cut is kept, here or in the store
            raise
        finally:
            client.close()
        self.store.keep(step, folder)

    def roll_back(self, lost: int, cut: dict, fence: int) -> None:
        """Every shard back to its cut of the checkpoint `cut` names, behind `fence` (pushes of
        rounds up to it refused): the others in place (their own cut, kept in their folder), the
        lost one in a pod made anew from its cut in the checkpoint store, at a new address that
        the routing's next epoch gives every shard (the workers re-route from their refusals).
        PsError or ConfigError (one line) when one cannot."""
        step, digests = int(cut["step"]), cut["digests"]
        if len(digests) != len(self.shards.shards):
            raise PsError(f"the checkpoint of step {step} has {len(digests)} shards' cuts, the job runs {len(self.shards.shards)} "
                          "(a scale --ps since)")
        files = self._kept_cut(step, lost, digests[lost])  # before any shard goes back
        client = PsClient(self.client.token, lambda: None, timeout_s=self.CUT_TIMEOUT_S)
        try:
            for shard in self.shards.shards:
                if shard.shard != lost:
                    asked(client, shard, {"op": "rollback", "step": step, "digest": digests[shard.shard], "fence": fence})
            restore = {"step": step, "digest": digests[lost], "routing": cut["routing"], "fence": fence}
            self.shards.shards[lost] = self.launcher.replace_shard(lost, self.shards.routing, restore, files)
            routing = RoutingTable(self.shards.routing.epoch + 1, self.shards.routing.owners,
                                   [s.endpoint for s in self.shards.shards])
            for shard in self.shards.shards:
                asked(client, shard, {"op": "routing", "routing": routing.to_json()})
            self.shards.routing = routing
        finally:
            client.close()
        self.states[lost], self.seen_restarts[lost] = PsShardState.SERVING, 0
        self.relaunches[lost] += 1
        log.info("parameter-server shards back at their cuts of step %d; shard %d in a new pod at %s", step, lost,
                 self.shards.shards[lost].endpoint)

    def _kept_cut(self, step: int, index: int, digest: str) -> dict[str, str]:
        """Shard `index`'s cut of `step` as this master copied it (keep_cut) or downloaded it (a
        resume), else from the checkpoint store; checked by its digest."""
        if self.store is None:
            raise PsError("the job keeps no checkpoint cuts (no checkpoint store)")
        for folder in (self.store.step_path(step), self.store.resumed_path(step)):
            files = {part: os.path.join(folder, part_name(index, part)) for part in PARTS}
            if all(os.path.exists(f) for f in files.values()) and files_digest([files[p] for p in PARTS]) == digest:
                return files
        return self.store.download(step, index, digest)

    def _watch(self) -> None:
        while not self.stopping.wait(self.POLL_S):
            try:
                pods = {p.metadata.name: p for p in self.launcher.list_pods()}
            except Exception as exc:  # an API error or timeout: look again at the next poll
                log.debug("listing the shard pods failed: %s", exc)
                continue
            for shard in self.shards.shards[: len(self.states)]:  # a scale --ps may be growing the list
                if self.states[shard.shard] is not PsShardState.DOWN and not self.stopping.is_set():
                    self._judge(shard, pods.get(ps_pod_name(self.launcher.names, shard.shard)))

    def _judge(self, shard: PodShard, pod: k8s.V1Pod | None) -> None:
        i = shard.shard
        phase = pod.status.phase if pod is not None and pod.status else None
        if pod is None or phase in ("Failed", "Succeeded") or (pod.metadata.deletion_timestamp is not None):
            self.states[i] = PsShardState.RELAUNCHING
            if self.lost is not None and self.lost(i):  # the job goes back to its newest checkpoint, this shard anew
                return
            log.error("parameter-server shard %d: its pod %s is %s; its rows were in that pod's emptyDir, so the shard is "
                      "down for good and the job cannot go on exactly once: run it again", i, ps_pod_name(self.launcher.names, i),
                      "gone" if pod is None else ("being deleted" if phase not in ("Failed", "Succeeded") else phase))
            self.states[i] = PsShardState.DOWN
            return
        restarts, running = _container_restarts(pod)
        if restarts > self.seen_restarts[i] or not running:
            if self.states[i] is PsShardState.SERVING:
                log.warning("parameter-server shard %d exited: the kubelet restarts it in its pod %s (same address, "
                            "its snapshot and ledger in the pod's emptyDir)", i, pod.metadata.name)
                self.states[i], self.since[i] = PsShardState.RELAUNCHING, time.monotonic()
            self.seen_restarts[i] = max(restarts, self.seen_restarts[i])
        if self.states[i] is PsShardState.RELAUNCHING and running and self.launcher.answers(self.client, shard.endpoint):
            self.relaunches[i] += 1
            self.states[i] = PsShardState.SERVING
            log.info("parameter-server shard %d back in %.2f s", i, time.monotonic() - self.since[i])
