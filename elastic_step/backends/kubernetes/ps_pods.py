"""A `--mode ps` job's parameter-server shards as pods of the job (the Kubernetes backend's
ShardLauncher, master/ps_shards.py).

Each shard is a pod of the workers' image running `python -m elastic_step.backends.kubernetes.ps_pods`
(which writes the shard's config.json from its env, then serves as elastic_step.ps.shard does),
labelled app.kubernetes.io/component=ps and elastic-step/ps-shard=I, bound to its pod IP on
PS_PORT + I, with the job token mounted as the workers have it. The master and the workers reach
it at that address; the job's `<instance>-ps` NetworkPolicy admits only the job's workers and
its master pod, on those ports.

Where the snapshot and ledger live: in an emptyDir of the shard's pod, whose restartPolicy is
OnFailure. A shard that dies (SIGKILL, OOM, a crash) is restarted in place by the kubelet: the
same pod, so the same IP and port (the workers' routes stay right) and the same emptyDir
(Kubernetes keeps it across container restarts), where it loads its snapshot and replays its
ledger's tail, exactly as ShardSupervisor relaunches a local shard process in its folder. The
kubelet's restart is immediate the first time, where a pod made anew would wait for scheduling
and image pulls, and no shard data crosses the network.

A pod that is deleted or evicted (a node drain, `kubectl delete pod`) loses its emptyDir, so
its rows. A new pod from the last checkpoint's cut alone would lose the pushes acknowledged after
it, which the workers do not send again. So the whole job goes back to its newest checkpoint S,
in process, and no worker restarts (master/ps_rollback.py drives it; PodSupervisor.roll_back
does the shards' part): every other shard is asked to `rollback` to its own cut of S (it keeps
the cut of every checkpoint a resume may load) behind a fence, refusing from then on every push
of a round up to the newest one the master has proposed (ps/state.py); the deleted shard's pod
is made anew once its name is free, starting from its cut of S as a resumed job's pods do (the
master's copy, JOB_DIR/ps-cuts, checked by its digest) behind the same fence; and every shard
takes the routing's next epoch with the new pod's address, from which the workers re-route. The
fence is by round, not by routing epoch: a worker still retrying a push to the deleted pod learns
the new address from the other shards and would re-send it there; refused, it ends its round
(ps/api.py's RoundFenced) and rendezvouses again. The master's next round then goes on from S
(the rows applied after S return to the queue, rank 0 loads the dense state of S). With no
checkpoint yet, or one of another routing (a scale --ps since), the shard is DOWN and the job
fails in one line, rather than going on with an empty shard and losing acknowledged updates.

The master watches the pods (a list every POLL_S, on its own thread): a restarted container is
RELAUNCHING until the shard answers again. At the job's end it asks each shard for its rows
(`export`), gives this process's models the trained tables (torch_embedding.freeze_tables), and
deletes the pods, whose SIGTERM makes each take a last snapshot and exit 0.

Checkpoints and resume (ps_cuts.py): each checkpoint's cut of the shards is copied from the
pods into the run's artifacts beside the checkpoint, ahead of its commit; a resumed job's new
shard pods each load exactly their cut of the checkpoint's step from there (through the master,
checked by its digest) before they serve.

`scale --ps N` (PodShards.resize) makes the added shards' pods, moves only the virtual shards
that change owner (ps/moves.py, as the local backend does) and deletes the pods of the removed
ones; the shards' NetworkPolicy admits the range of ports any count may use, so it stays as it is."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass, replace

import numpy as np
import urllib3
from kubernetes import client as k8s

from elastic_step.backends.kubernetes.manifests import (ISTIO_INJECT_LABEL, TOKEN_KEY, TOKEN_MOUNT, JobNames, job_pod_spec,
                                                         master_selector, owner_references, resources,
                                                         restricted_container)
from elastic_step.backends.kubernetes.options import MasterPod, PodSettings
from elastic_step.backends.kubernetes.ps_cuts import CutStore, fetch_cut, part_name, receive_cut, restored, send_cut
from elastic_step.errors import ConfigError
from elastic_step.protocol import PsShardState, WorkerEnv
from elastic_step.ps import wire
from elastic_step.ps.cuts import PARTS, CutMissing, files_digest
from elastic_step.ps.api import PsError, Status, TableSpec
from elastic_step.ps.client import PsClient
from elastic_step.ps.moves import MoveReport, export_parts, move
from elastic_step.ps.routing import DEFAULT_VIRTUAL_SHARDS, RoutingTable

log = logging.getLogger("elastic_step.backends.kubernetes")

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


@dataclass
class PodShard:
    shard: int
    host: str  # the pod's IP
    port: int

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"


class PodShards:
    """The shards' addresses under one routing table (what LocalShards is for processes)."""

    def __init__(self, shards: list[PodShard], routing: RoutingTable, launcher: PsPods | None = None):
        self.shards, self.routing, self.launcher = shards, routing, launcher

    def routes(self) -> RoutingTable:
        return RoutingTable(self.routing.epoch, self.routing.owners, [s.endpoint for s in self.shards])

    def resize(self, shards: int, call) -> MoveReport:
        """`scale --ps`: run `shards` shard pods from now on, moving only the virtual shards that
        change owner (ps/moves.py) while the workers go on, as LocalShards.resize does with
        processes. Added pods start empty under the current routing; removed ones (the highest
        indices) leave the list once they gave everything away, then their pods are deleted.
        `call(endpoint, header, *arrays)` asks one shard."""
        added = self.launcher.add_shards(range(len(self.shards), shards), self.routing)
        everyone = self.shards + added
        resized = self.routing.resized(shards, [s.endpoint for s in everyone[:shards]])
        try:
            report = move(lambda i, *request: call(everyone[i].endpoint, *request), self.routing, resized)
        except BaseException:
            self.shards = everyone  # deleted with the others at the end (a resume from a cut needs no move)
            raise
        self.routing = resized
        self.shards = everyone[:shards]
        self.launcher.delete_shards([s.shard for s in everyone[shards:]])
        return report


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
                    _asked(client, shard, {"op": "rollback", "step": step, "digest": digests[shard.shard], "fence": fence})
            restore = {"step": step, "digest": digests[lost], "routing": cut["routing"], "fence": fence}
            self.shards.shards[lost] = self.launcher.replace_shard(lost, self.shards.routing, restore, files)
            routing = RoutingTable(self.shards.routing.epoch + 1, self.shards.routing.owners,
                                   [s.endpoint for s in self.shards.shards])
            for shard in self.shards.shards:
                _asked(client, shard, {"op": "routing", "routing": routing.to_json()})
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


def _asked(client: PsClient, shard: PodShard, request: dict) -> dict:
    """One shard's OK answer to `request`; PsError saying why not."""
    try:
        header, _ = client.call(shard.endpoint, request)
    except (OSError, ValueError) as exc:
        raise PsError(f"shard {shard.shard} at {shard.endpoint} did not answer its {request['op']} ({exc})") from None
    if header.get("status") != Status.OK:
        raise PsError(f"shard {shard.shard} refused its {request['op']}: {header.get('detail') or header.get('status')}")
    return header


def _exported(client: PsClient, shard: PodShard, vshards: list[int]):
    """The rows of a shard's virtual shards, a message's worth at a time (moves.export_parts):
    one message of a table of several GiB would be over what a frame may carry."""
    stats = _asked(client, shard, {"op": "stats"})
    held = sum(int(t["bytes"]) for t in stats["tables"].values())
    for part in export_parts(vshards, held, len(vshards)):
        reply, body = client.call(shard.endpoint, {"op": "export", "vshards": part})
        yield wire.unpack(reply["arrays"], body)


class PsPods:
    """The Kubernetes backend's ShardLauncher: the shard pods, their NetworkPolicy, their
    watcher, and the last rows at the job's end."""

    READY_TIMEOUT_S = 300.0  # scheduling and an image pull, then the shard's start
    CREATE_TRIES = 3
    EXPORT_TIMEOUT_S = 120.0

    def __init__(self, backend):
        self.backend = backend
        self.api, self.namespace, self.timeout_s = backend.api, backend.settings.namespace, backend.timeout_s
        self.names: JobNames = backend.names
        self.made: list[str] = []
        self.specs: list[TableSpec] = []
        self.checkpoint_every = 0
        self.client: PsClient | None = None

    def list_pods(self) -> list[k8s.V1Pod]:
        return self.api.list_namespaced_pod(self.namespace, label_selector=ps_selector(self.names),
                                            _request_timeout=self.timeout_s).items

    @staticmethod
    def answers(client: PsClient, endpoint: str) -> bool:
        try:
            return client.call(endpoint, {"op": "stats"})[0].get("status") == Status.OK
        except (OSError, ValueError):
            return False

    def start_shards(self, specs: list[TableSpec], count: int, token: str, resuming: bool, running: contextlib.ExitStack,
                     cut: dict | None = None, checkpoints=None, checkpoint_every: int = 0) -> PodSupervisor:
        """`cut`: a resumed checkpoint's cut of the shards, which the new pods start from (from
        `checkpoints`, the run's checkpoint store, where each checkpoint's cut is kept too)."""
        store = CutStore(checkpoints, self.backend.spec.job_dir) if checkpoints is not None else None
        files = self._resumed_cuts(cut, store) if resuming else None
        routing = RoutingTable.from_json(cut["routing"]) if files else RoutingTable.initial(count)
        count = routing.shards
        running.callback(self._delete_pods)  # also when a start fails half-way
        self._create_policy()
        self.specs, self.checkpoint_every = specs, checkpoint_every
        for shard in range(count):
            restore = {"step": int(cut["step"]), "digest": cut["digests"][shard], "routing": cut["routing"]} if files else None
            self._create_pod(shard, routing, restore)
        self.client = client = PsClient(token, lambda: None, timeout_s=5.0)
        running.callback(client.close)
        shards = PodShards(self._wait_ready(range(count), client, files), routing, self)
        if files:
            self._log_restored(client, shards, specs, int(cut["step"]))
        running.callback(self._freeze, specs, shards, token)  # before the pods go (last in, first out)
        return PodSupervisor(self, shards, client, store).start()

    def _create_pod(self, shard: int, routing: RoutingTable, restore: dict | None = None) -> None:
        backend = self.backend
        config = shard_config(self.specs, routing, checkpoint_every=self.checkpoint_every)
        pod = ps_pod(backend.settings, self.names, backend.master, backend.image, shard, config, restore)
        self._create(f"parameter-server pod {pod.metadata.name}", self.api.create_namespaced_pod, pod)
        self.made.append(pod.metadata.name)

    def add_shards(self, indices: range, routing: RoutingTable) -> list[PodShard]:
        """New shard pods (a scale --ps), empty under `routing`, once they serve. ValueError (the
        API's 409) when one cannot be made or does not serve."""
        client = PsClient(self.client.token, lambda: None, timeout_s=5.0)  # the watcher uses the other one
        try:
            for shard in indices:
                self._create_pod(shard, routing)
            return self._wait_ready(indices, client)
        except ConfigError as exc:
            self.delete_shards(list(indices))
            raise ValueError(f"scale --ps: {exc}") from None
        finally:
            client.close()

    def replace_shard(self, index: int, routing: RoutingTable, restore: dict, files: dict[str, str]) -> PodShard:
        """Shard `index`'s pod made anew (its pod was deleted) once the old one is gone, under
        `routing`, starting from the cut `restore` names (`files`, sent to it before it serves)."""
        name = ps_pod_name(self.names, index)
        self._delete([name])  # an evicted pod stays (Failed) until deleted; one being deleted keeps its grace
        deadline = time.monotonic() + self.READY_TIMEOUT_S
        while any(pod.metadata.name == name for pod in self.list_pods()):  # its name is free once it is gone
            if time.monotonic() > deadline:
                raise ConfigError(f"the deleted parameter-server pod {name} was still there after {self.READY_TIMEOUT_S:.0f} s")
            time.sleep(0.2)
        self.made = [made for made in self.made if made != name]
        self._create_pod(index, routing, restore)
        client = PsClient(self.client.token, lambda: None, timeout_s=5.0)  # the watcher's is in use
        try:
            return self._wait_ready(range(index, index + 1), client, {index: files})[0]
        finally:
            client.close()

    def delete_shards(self, indices: list[int]) -> None:
        """SIGTERM these shards (a last snapshot, exit 0) by deleting their pods."""
        names = {ps_pod_name(self.names, i) for i in indices}
        self._delete([name for name in self.made if name in names])
        self.made = [name for name in self.made if name not in names]

    def _resumed_cuts(self, cut: dict | None, store: CutStore | None) -> list[dict[str, str]]:
        """Each shard's cut of the resumed checkpoint, from the checkpoint store, checked by its
        digest; ConfigError (one line) when the checkpoint has none or the store lacks one."""
        if cut is None or store is None:
            raise ConfigError("--mode ps on the Kubernetes backend: the checkpoint to resume from holds no cut of the "
                              "parameter-server shards (taken before cuts were kept), and their rows went with their pods; "
                              "start the job over (a new --job-name, or without --resume)")
        files = []
        for index, digest in enumerate(cut["digests"]):
            try:
                files.append(store.download(int(cut["step"]), index, digest))
            except (OSError, ValueError) as exc:
                raise ConfigError(f"train --resume: the checkpoint of step {cut['step']} needs parameter-server shard {index}'s "
                                  f"cut, but {exc}; resume from another checkpoint of the run, or start over without --resume") from None
        return files

    def _log_restored(self, client: PsClient, shards: PodShards, specs: list[TableSpec], step: int) -> None:
        """What each shard holds as it starts from its cut: each table's hash (the digest request)."""
        for shard in shards.shards:
            for spec in specs:
                digest = client.call(shard.endpoint, {"op": "digest", "table": spec.name})[0].get("digest")
                log.info("parameter-server shard %d starts from its cut of step %d: table %s digest %s", shard.shard, step,
                         spec.name, digest)

    def _create(self, what: str, create, body) -> None:
        """Create `body` with the API call `create`; a refusal ends the job in one line naming it.
        A call that timed out or met a server error is made again (CREATE_TRIES in all): the
        object is named, so a 409 after such a call is the object that call made."""
        for attempt in range(self.CREATE_TRIES):
            try:
                create(self.namespace, body, _request_timeout=self.timeout_s)
                return
            except k8s.ApiException as exc:
                if exc.status == 409 and attempt:
                    return
                if exc.status == 409:  # on a first try: one of that name is still there
                    raise ConfigError(f"cannot create {what} in namespace {self.namespace}: one of that name still exists "
                                      "(a removed shard's pod still terminating?); try again once it is gone") from None
                if (exc.status is not None and exc.status < 500) or attempt + 1 == self.CREATE_TRIES:
                    raise ConfigError(f"cannot create {what} in namespace {self.namespace}: {exc.status} {exc.reason}; "
                                      "the master's service account needs the Role and admission policy in deploy/rbac") from None
            except urllib3.exceptions.HTTPError as exc:  # a timeout, a dropped connection
                if attempt + 1 == self.CREATE_TRIES:
                    raise ConfigError(f"cannot create {what} in namespace {self.namespace}: the API server did not answer "
                                      f"({type(exc).__name__}) in {self.CREATE_TRIES} tries") from None
            log.warning("creating %s: the API server did not answer; trying again", what)

    def _create_policy(self) -> None:
        backend = self.backend
        policy = ps_network_policy(self.names, backend.master, self.namespace, backend.master_labels)
        self._create(f"the shards' NetworkPolicy {policy.metadata.name}", backend.networking.create_namespaced_network_policy,
                     policy)
        backend.network_policies.append(policy.metadata.name)  # deleted with the job's others

    def _wait_ready(self, indices: range, client: PsClient, files: list[dict[str, str]] | None = None) -> list[PodShard]:
        """Each of these shards once its pod has an IP and the shard answers there; a resumed one
        is sent its cut first (`files`, by shard), which it loads before it answers."""
        deadline, ready, sent = time.monotonic() + self.READY_TIMEOUT_S, {}, set()
        while len(ready) < len(indices):
            for pod in self.list_pods():
                shard = int(pod.metadata.labels.get(SHARD_LABEL, -1))
                phase = pod.status.phase if pod.status else None
                if phase in ("Failed", "Succeeded"):
                    raise ConfigError(f"parameter-server pod {pod.metadata.name} ended ({phase}) before it served; "
                                      f"see: kubectl logs -n {self.namespace} {pod.metadata.name}")
                if shard in indices and shard not in ready and pod.status and pod.status.pod_ip:
                    candidate = PodShard(shard, pod.status.pod_ip, PS_PORT + shard)
                    if files and shard not in sent:
                        sent.update([shard] if self._send_cut(client, candidate, files[shard]) else [])
                    elif self.answers(client, candidate.endpoint):
                        ready[shard] = candidate
            if time.monotonic() > deadline:
                missing = sorted(set(indices) - set(ready))
                raise ConfigError(f"parameter-server shards {missing} did not serve within {self.READY_TIMEOUT_S:.0f} s; "
                                  f"see: kubectl describe pods -n {self.namespace} -l {ps_selector(self.names)}")
            time.sleep(0.2)
        log.info("parameter-server pods serving: %s", ", ".join(ready[i].endpoint for i in indices))
        return [ready[i] for i in indices]

    def _send_cut(self, client: PsClient, shard: PodShard, files: dict[str, str]) -> bool:
        """Shard `shard`'s cut to its pod; False while the pod does not listen yet; ConfigError
        (one line) when the pod refuses it (its digest differs)."""
        try:
            send_cut(client, shard.endpoint, files)
        except OSError:
            return False
        except PsError as exc:
            raise ConfigError(f"train --resume: parameter-server shard {shard.shard} refused its cut: {exc}; resume from another "
                              "checkpoint of the run, or start over without --resume") from None
        log.info("parameter-server shard %d: its cut sent to %s", shard.shard, shard.endpoint)
        return True

    def _freeze(self, specs: list[TableSpec], shards: PodShards, token: str) -> None:
        """Every shard's rows (`export` of the virtual shards it owns), as this process's models'
        trained tables (torch_embedding.freeze_tables)."""
        from elastic_step.ps.torch_embedding import freeze_tables

        client = PsClient(token, lambda: None, timeout_s=self.EXPORT_TIMEOUT_S)
        parts: dict[str, list] = {s.name: [] for s in specs}
        try:
            for shard in shards.shards:
                try:
                    for arrays in _exported(client, shard, shards.routing.owned_by(shard.shard).tolist()):
                        for spec in specs:
                            parts[spec.name].append((arrays[f"{spec.name}.ids"], arrays[f"{spec.name}.rows"][:, : spec.dim]))
                except (OSError, ValueError) as exc:
                    log.error("parameter-server shard %d did not give its rows (%s): its ids get zero rows in the "
                              "evaluation and the exported model", shard.shard, exc)
        finally:
            client.close()
        tables = {}
        for spec in specs:
            ids = [np.zeros(0, np.int64)] + [p[0] for p in parts[spec.name]]
            rows = [np.zeros((0, spec.dim), np.float32)] + [p[1] for p in parts[spec.name]]
            tables[spec.name] = (np.concatenate(ids), np.concatenate(rows))
        freeze_tables(tables)

    def _delete_pods(self) -> None:
        """SIGTERM each shard (a last snapshot, exit 0) by deleting its pod."""
        self._delete(self.made)
        self.made = []

    def _delete(self, names: list[str]) -> None:
        for name in names:
            try:
                self.api.delete_namespaced_pod(name, self.namespace, _request_timeout=self.timeout_s)
            except Exception as exc:
                if getattr(exc, "status", None) != 404:
                    log.warning("deleting parameter-server pod %s failed: %s", name, exc)


def main(argv: list[str] | None = None) -> int:
    """A shard pod's command: its config.json written from the env (again after each restart:
    the same text); in a resumed job's pod, its cut received from the master first (once: a
    restarted container finds it in place); then the shard itself with the folder and token file
    the env names, which recovers from the folder's snapshot and ledger before it listens."""
    from elastic_step.ps import shard
    from elastic_step.ps.shard import CONFIG_FILE

    missing = [name for name in (CONFIG_ENV, DIR_ENV, WorkerEnv.TOKEN_FILE.value) if not os.environ.get(name)]
    if missing:
        print(f"elastic_step.backends.kubernetes.ps_pods: {', '.join(missing)} not set; this runs in a shard pod the master makes",
              file=sys.stderr)
        return 2
    directory, token_file = os.environ[DIR_ENV], os.environ[WorkerEnv.TOKEN_FILE.value]
    os.makedirs(directory, exist_ok=True)
    partial = os.path.join(directory, CONFIG_FILE + ".partial")
    with open(partial, "w", encoding="utf-8") as f:
        f.write(os.environ[CONFIG_ENV])
    os.replace(partial, os.path.join(directory, CONFIG_FILE))
    argv = list(sys.argv[1:] if argv is None else argv)
    if os.environ.get(RESTORE_ENV) and not restored(directory):
        address = argparse.ArgumentParser(add_help=False)
        address.add_argument("--host", required=True)
        address.add_argument("--port", type=int, required=True)
        where = address.parse_known_args(argv)[0]
        try:
            token = wire.read_token(token_file)
        except (OSError, ValueError) as exc:  # as the shard itself says of its token file
            print(f"elastic_step.backends.kubernetes.ps_pods: {exc}; the pod mounts the job's token Secret there", file=sys.stderr)
            return 2
        log.info("waiting for this shard's checkpoint cut from the master at %s:%d", where.host, where.port)
        try:
            receive_cut(directory, where.host, where.port, token, json.loads(os.environ[RESTORE_ENV]))
        except CutMissing as exc:  # the master stops the resume in one line too
            print(f"elastic_step.backends.kubernetes.ps_pods: the cut the master sent was refused: {exc}", file=sys.stderr)
            return 2
    return shard.main([*argv, "--dir", directory, "--token-file", token_file])


if __name__ == "__main__":
    sys.exit(main())
