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
RELAUNCHING until the shard answers again. At the job's end it gives this process's models the
trained tables (ps_final.py: the shards' rows held whole, or past --ps-table-limit-mb their
snapshots copied from the pods), and deletes the pods, whose SIGTERM makes each take a last
snapshot and exit 0.

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
import sys
import time

import urllib3
from kubernetes import client as k8s

from elastic_step import defaults
from elastic_step.backends.kubernetes.manifests import JobNames
from elastic_step.backends.kubernetes.ps_cuts import CutStore, receive_cut, restored, send_cut
from elastic_step.backends.kubernetes.ps_manifests import (CONFIG_ENV, DIR_ENV, PS_PORT, RESTORE_ENV, SHARD_LABEL, ps_network_policy,
                                                            ps_pod, ps_pod_name, ps_selector, shard_config)
from elastic_step.backends.kubernetes.ps_pod_shards import PodShard, PodShards
from elastic_step.backends.kubernetes.ps_pod_watch import PodSupervisor
from elastic_step.errors import ConfigError
from elastic_step.protocol import WorkerEnv
from elastic_step.ps import wire
from elastic_step.ps.cuts import CutMissing
from elastic_step.ps.api import PsError, Status, TableSpec
from elastic_step.ps.client import PsClient
from elastic_step.ps.routing import RoutingTable

log = logging.getLogger("elastic_step.backends.kubernetes")


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
        self.table_limit_mb = float(defaults.PS_TABLE_LIMIT_MB)
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
                     cut: dict | None = None, checkpoints=None, checkpoint_every: int = 0,
                     table_limit_mb: float = defaults.PS_TABLE_LIMIT_MB) -> PodSupervisor:
        """`cut`: a resumed checkpoint's cut of the shards, which the new pods start from (from
        `checkpoints`, the run's checkpoint store, where each checkpoint's cut is kept too).
        `table_limit_mb`: --ps-table-limit-mb, for the tables at the job's end (ps_final.py)."""
        store = CutStore(checkpoints, self.backend.spec.job_dir) if checkpoints is not None else None
        files = self._resumed_cuts(cut, store) if resuming else None
        routing = RoutingTable.from_json(cut["routing"]) if files else RoutingTable.initial(count)
        count = routing.shards
        running.callback(self._delete_pods)  # also when a start fails half-way
        self._create_policy()
        self.specs, self.checkpoint_every, self.table_limit_mb = specs, checkpoint_every, table_limit_mb
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
        """The shards' trained tables for this process's models (ps_final.py), while the pods serve."""
        from elastic_step.backends.kubernetes.ps_final import freeze  # the master's models: not in a shard pod's imports

        client = PsClient(token, lambda: None, timeout_s=self.EXPORT_TIMEOUT_S)
        try:
            freeze(client, specs, shards, self.backend.spec.job_dir, self.table_limit_mb)
        finally:
            client.close()

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
