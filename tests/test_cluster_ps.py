"""A `--mode ps` job on the cluster stand-in: the master pod runs its parameter-server shards as
pods of the job (backends/kubernetes/ps_pods.py) beside its worker pods.

Unit level: a shard pod's manifest (labels, the workers' service account and security context,
the shard's folder an emptyDir of a pod restarted in place, its address and token from the env)
and the shards' NetworkPolicy (the job's workers and master, the shards' ports, nothing else);
a checkpoint's cut carried from a shard through the master into a new pod's folder, only when
its digest holds (ps_cuts.py).

End to end (tests/cluster with its pod network: each pod its own address, the job's
NetworkPolicies enforced): a DeepFM job of two worker pods and two shard pods on the synthetic CTR
data read from a private bucket. `scale --ps 3` adds a shard pod and moves at most 1/3 + 5% of
the rows. Once the run has committed a checkpoint of the three shards, the master's container is
SIGKILLed; a new master pod runs the same command (`--ps-shards 2`) with --resume, and makes
three shard pods, the scaled routing's, each of which starts from exactly its cut of that
checkpoint, which the run's artifacts hold (the table hash of the cut, loaded and replayed by the
test). Then one shard's container is SIGKILLed (`docker kill`), and a pod without the job's
labels cannot connect to the shards. The kubelet restarts it in its pod, where it loads its snapshot and replays its ledger from the pod's
emptyDir, at the same address; the workers retry what it had not acknowledged and none of them
restarts. Once a checkpoint of the three shards is committed, another shard's pod is deleted
through the API, its emptyDir with it: the job goes back to its newest checkpoint in process
(master/ps_rollback.py: every shard to its cut behind a fence of the rounds before, that shard
in a new pod from its cut, the workers' rows after the checkpoint back to the queue), and no
worker restarts. Once every row is trained, each embedding row's update counter on the shards (asked
from the master pod's network) equals the count computed from the data alone (each minibatch
updates each of its distinct ids once): nothing acknowledged was lost and nothing applied twice,
across the kills and the deletion. Its tables, past `--ps-table-limit-mb 0`, are not held whole:
the master copies each shard pod's last snapshot over the shard protocol and evaluates the model
on them. The job then succeeds and leaves none of its pods or NetworkPolicies, nor does the
killed master's.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import time
from collections import Counter

import pytest
from kubernetes import client as k8s

from cluster import Cluster, venv_image
from conftest import synthetic_clicks
from elastic_step.backends.kubernetes.manifests import JobNames, to_dict
from elastic_step.backends.kubernetes.options import MasterPod, PodSettings
from elastic_step.backends.kubernetes.ps_manifests import PS_PORT, ps_network_policy, ps_pod
from elastic_step.ps.routing import RoutingTable
from stores import S3Server, upload
from test_cluster_e2e import JOB_DIR, master_pod, store_secret
from test_cluster_network import PROBE, MasterOnPodNetwork, pod_network_cluster, python_pod
from test_ps_mode import DEEPFM_PS, counters_from_the_data

TEST_IMAGE = "registry.example/ml/elastic-step-torch-test:0.1.0"
# 6 epochs: enough steps for the scale and a checkpoint after it before the master's SIGKILL, and
# after the resume for the shard pod's SIGKILL and the pod deletion (with 2, on an idle machine,
# the resumed job ended 2 s after a scale).
ROWS_PER_SHARD, MINIBATCH, EPOCHS = 800, 128, 6


def test_a_shard_pod_runs_as_a_worker_with_its_folder_kept_across_restarts():
    names = JobNames.for_job("ctr", suffix="abc123")
    master = MasterPod(name="train-step", namespace="ml", uid="abc123-uid", ip="10.0.0.5")
    settings = PodSettings(namespace="ml", image=None, cpu_request="500m", memory_request="1Gi", gpus=1)
    pod = to_dict(ps_pod(settings, names, master, "img:1", 1, '{"tables": []}'))
    labels = pod["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "ps" and labels["elastic-step/ps-shard"] == "1"
    assert labels["app.kubernetes.io/instance"] == "ctr-abc123" and labels["sidecar.istio.io/inject"] == "false"
    assert pod["metadata"]["name"] == "ctr-abc123-ps-1" and pod["metadata"]["ownerReferences"][0]["uid"] == "abc123-uid"
    spec = pod["spec"]
    assert spec["restartPolicy"] == "OnFailure"  # the kubelet restarts a dead shard in place: same IP, same emptyDir
    assert spec["serviceAccountName"] == "elastic-step-worker" and spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = spec["containers"]
    assert container["image"] == "img:1" and container["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}
    assert container["resources"] == {"requests": {"cpu": "500m", "memory": "1Gi"}}  # the workers' requests, no GPU
    assert container["command"][-4:] == ["--host", "$(ELASTIC_STEP_POD_IP)", "--port", str(PS_PORT + 1)]
    env = {e["name"]: e for e in container["env"]}
    assert env["ELASTIC_STEP_POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["ELASTIC_STEP_TOKEN_FILE"]["value"] == "/var/run/elastic-step/token/token"  # a file, never the token
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["scratch"] == {"name": "scratch", "emptyDir": {}}
    assert volumes["token"]["secret"] == {"secretName": "ctr-abc123-token", "defaultMode": 0o440}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert env["ELASTIC_STEP_PS_DIR"]["value"].startswith("/tmp/") and mounts["/tmp"]["name"] == "scratch"


def test_the_shards_admit_the_jobs_workers_and_master_on_their_ports_only():
    names = JobNames.for_job("ctr", suffix="abc123")
    master_labels = {"app.kubernetes.io/name": "train-step", "workflows.argoproj.io/completed": "false"}
    policy = to_dict(ps_network_policy(names, None, "ml", master_labels))
    assert policy["metadata"]["name"] == "ctr-abc123-ps"
    assert policy["spec"]["podSelector"] == {"matchLabels": {"app.kubernetes.io/instance": "ctr-abc123", "app.kubernetes.io/component": "ps"}}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    # The ports of as many shards as there are virtual shards (the most a scale --ps may run): no policy change at a scale.
    assert rule["ports"] == [{"protocol": "TCP", "port": PS_PORT, "endPort": PS_PORT + 127}]
    assert [peer["podSelector"]["matchLabels"] for peer in rule["from"]] == [
        {"app.kubernetes.io/instance": "ctr-abc123", "app.kubernetes.io/component": "worker"},
        {"app.kubernetes.io/name": "train-step"}]  # the master by its stable labels
    # A master pod without labels is left out, never admitted as an empty selector (every pod).
    unlabelled = to_dict(ps_network_policy(names, None, "ml", {}, 1))
    assert [peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for peer in unlabelled["spec"]["ingress"][0]["from"]] == ["worker"]


def test_a_ps_jobs_dry_run_shows_its_shard_pods_valid_and_podsecurity_restricted(tmp_path, monkeypatch):
    """`train --backend kubernetes --mode ps --dry-run`: the shard pods and their policy with the
    rest, each as the API server's schema takes it (strict), the pods restricted."""
    import kubernetes_validate
    import yaml

    from elastic_step.backends.kubernetes.manifests import dry_run_manifests
    from elastic_step.backends.kubernetes.options import settings_from_config
    from elastic_step.config import TrainConfig
    from test_step_pod_security import violations

    monkeypatch.setenv("ELASTIC_STEP_POD_NAMESPACE", "ml")
    config = TrainConfig(model_def=DEEPFM_PS, data="s3://bucket/ctr", job_dir=str(tmp_path), workers="2", backend="kubernetes",
                         mode="ps", ps_shards=3, host="10.0.0.5", worker_memory="1Gi", ps_memory="3Gi")
    master = MasterPod(name="m", uid="u", ip="10.0.0.5", namespace="ml")
    objects = [o for o in yaml.safe_load_all(dry_run_manifests(config, settings_from_config(config), master, "img:1")) if o]
    for obj in objects:
        kubernetes_validate.validate(obj, "1.30.0", strict=True)
    shards = [o for o in objects if o["kind"] == "Pod" and o["metadata"]["labels"]["app.kubernetes.io/component"] == "ps"]
    assert [p["metadata"]["labels"]["elastic-step/ps-shard"] for p in shards] == ["0", "1", "2"]
    assert all(violations(pod) == [] for pod in shards), [violations(p) for p in shards]
    assert {p["spec"]["containers"][0]["resources"]["limits"]["memory"] for p in shards} == {"3Gi"}  # --ps-memory
    workers = [o for o in objects if o["kind"] == "Pod" and o["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"]
    assert {p["spec"]["containers"][0]["resources"]["limits"]["memory"] for p in workers} == {"1Gi"}
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "NetworkPolicy"][-1].endswith("-ps")


class _Pods:
    """The launcher's pod list as the supervisor sees it, set by the test."""

    names = JobNames.for_job("ctr", suffix="abc123")

    def __init__(self):
        self.pods, self.serving = [], True

    def list_pods(self):
        return self.pods

    def answers(self, client, endpoint):
        return self.serving


def _shard_pod(restarts: int, running: bool, phase: str = "Running"):
    state = k8s.V1ContainerState(running=k8s.V1ContainerStateRunning() if running else None)
    return k8s.V1Pod(metadata=k8s.V1ObjectMeta(name="ctr-abc123-ps-0"), status=k8s.V1PodStatus(
        phase=phase, container_statuses=[k8s.V1ContainerStatus(name="ps", restart_count=restarts, state=state, image="i",
                                                                image_id="", ready=running)]))


def test_a_restarted_shard_is_relaunching_until_it_answers_and_a_gone_pod_rolls_the_job_back_or_is_down():
    from elastic_step.backends.kubernetes.ps_pod_shards import PodShard, PodShards
    from elastic_step.backends.kubernetes.ps_pod_watch import PodSupervisor

    pods = _Pods()
    supervisor = PodSupervisor(pods, PodShards([PodShard(0, "10.0.0.7", PS_PORT)], RoutingTable.initial(1)), client=None)
    judge = lambda pod: supervisor._judge(supervisor.shards.shards[0], pod)  # noqa: E731
    judge(_shard_pod(0, running=True))
    assert supervisor.states == ["serving"] and supervisor.relaunches == [0]
    pods.serving = False  # SIGKILLed; the kubelet restarted the container, which replays its ledger
    judge(_shard_pod(1, running=True))
    assert supervisor.states == ["relaunching"]
    pods.serving = True
    judge(_shard_pod(1, running=True))
    assert supervisor.states == ["serving"] and supervisor.relaunches == [1]
    asked = []
    supervisor.lost = lambda shard: asked.append((shard, supervisor.states[shard])) or True  # the job goes back (ps_rollback.py)
    deleting = _shard_pod(1, running=True)
    deleting.metadata.deletion_timestamp = "now"  # `kubectl delete pod`: its container is still stopping
    judge(deleting)
    assert asked == [(0, "relaunching")] and supervisor.states == ["relaunching"]  # until the rollback has made it anew
    supervisor.lost = lambda shard: asked.append((shard, supervisor.states[shard])) and False  # no checkpoint to go back to
    judge(None)  # deleted: its emptyDir, so its rows, went with it
    assert asked[1:] == [(0, "relaunching")] and supervisor.states == ["down"]


def test_a_checkpoints_cut_goes_from_a_shard_through_the_master_into_a_new_pods_folder_only_when_its_digest_holds(tmp_path):
    """ps_cuts.py in process: a shard serving its cut of step 2 (ps/shard.py's `cut_file`), the
    master copying it (fetch_cut, checked by the digest) and sending it to a new pod waiting
    for it (receive_cut); that folder's shard then holds step 2's table, not the later one. A
    cut whose bytes are not the recorded digest's is refused on both sides (the pod's wait ends
    saying so) and leaves the folder empty. A request without the job's token is refused, and the
    pod waits on for the master's."""
    import threading

    from elastic_step.backends.kubernetes.ps_cuts import RESTORING, fetch_cut, receive_cut, restored, send_cut
    from elastic_step.ps.api import PsError
    from elastic_step.ps.client import PsClient
    from elastic_step.ps.cuts import CutMissing
    from elastic_step.ps.shard import ShardServer
    from elastic_step.ps.wire import FrameError
    from test_ps_cuts import push, shard

    held = shard(tmp_path / "old")
    push(held, 1), push(held, 2)
    at_checkpoint = held.tables["emb"].digest()
    push(held, 3)  # after the checkpoint's step: not in its cut
    cut = held.cut(2)
    server = ShardServer(("127.0.0.1", 0), held, "t0k")
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    client = PsClient("t0k", lambda: None, timeout_s=10.0)
    try:
        endpoint = f"127.0.0.1:{server.server_address[1]}"
        (tmp_path / "copied").mkdir()
        with pytest.raises(PsError):
            fetch_cut(client, endpoint, 2, str(tmp_path / "copied"), 0, "0" * 64)
        fetch_cut(client, endpoint, 2, str(tmp_path / "copied"), 0, cut["digest"])
    finally:
        server.shutdown()
        server.server_close()
    files = {part: str(tmp_path / "copied" / f"shard-0.{part}") for part in ("bin", "ledger")}

    def sent(by: PsClient, endpoint: str) -> str:
        """What a pod waiting for its cut answered `by`'s send_cut, once it listens."""
        deadline = time.monotonic() + 30
        while True:
            try:
                send_cut(by, endpoint, files)
                return "ok"
            except PsError as exc:
                return str(exc)
            except OSError:  # not listening yet
                assert time.monotonic() < deadline
                time.sleep(0.05)

    def pod(folder, digest, intruder: bool = False, early: PsClient | None = None) -> tuple[str, str]:
        """A resumed shard pod's first phase at a port of its own, sent the cut: (what the master
        was answered, how the pod's wait ended). `intruder`: someone without the job's token
        sends a cut first. `early`: a client (the master's stats poll) that asks before the cut
        came, and keeps its connection."""
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        ended = []

        def waiting():
            try:
                receive_cut(str(folder), "127.0.0.1", port, "t0k", {"step": 2, "digest": digest, "routing": cut["routing"]})
                ended.append("restored")
            except CutMissing as exc:
                ended.append(str(exc))

        thread = threading.Thread(target=waiting, daemon=True)
        thread.start()
        if early is not None:
            deadline = time.monotonic() + 30
            while True:
                try:
                    assert early.call(f"127.0.0.1:{port}", {"op": "stats"})[0]["status"] == RESTORING
                    break
                except OSError:  # not listening yet
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
            early.endpoint = f"127.0.0.1:{port}"
        if intruder:  # refused, and the pod waits on for the master's
            wrong = PsClient("wrong", lambda: None, timeout_s=10.0)
            assert sent(wrong, f"127.0.0.1:{port}") == "missing or wrong job token"
            wrong.close()
            assert thread.is_alive() and not restored(str(folder))
        answered = sent(client, f"127.0.0.1:{port}")
        thread.join(10)
        return answered, ended[0]

    (tmp_path / "forged").mkdir()
    answered, ended = pod(tmp_path / "forged", "0" * 64)
    assert "SHA-256" in answered and "SHA-256" in ended
    assert not restored(str(tmp_path / "forged")) and not (tmp_path / "forged" / "snapshot.bin").exists()
    (tmp_path / "new").mkdir()
    early = PsClient("t0k", lambda: None, timeout_s=10.0)
    assert pod(tmp_path / "new", cut["digest"], intruder=True, early=early) == ("ok", "restored")
    assert restored(str(tmp_path / "new"))
    # The early client's connection was closed with the wait: it connects again, to the shard that
    # now listens there, instead of being answered 'restoring' on it for good.
    with pytest.raises((OSError, FrameError)):
        early.call(early.endpoint, {"op": "stats"})
    early.close()
    assert shard(tmp_path / "new").tables["emb"].digest() == at_checkpoint
    client.close()


def test_a_checkpoint_is_recorded_only_after_its_cut_is_kept_and_the_store_keeps_the_cuts_a_resume_may_load(tmp_path):
    """keeping_cuts (master/ps_shards.py): a checkpoint whose cut the shard pods cannot give up
    is not recorded, one that they do is recorded after the cut's upload was queued (the
    uploader runs in order). CutStore: the cuts of checkpoints the run no longer keeps go, those
    it keeps and newer ones (still uploading) stay."""
    import types

    from elastic_step.backends.kubernetes.ps_cuts import CutStore
    from elastic_step.master.ps_checkpoints import PS_CUT
    from elastic_step.master.ps_shards import keeping_cuts
    from elastic_step.ps.api import PsError

    calls = []

    def keep_cut(cut):
        calls.append(("keep", cut["step"]))
        if cut["step"] == 4:
            raise PsError("shard 1 did not give its cut of step 4: gone")

    monitor = types.SimpleNamespace(supervisor=types.SimpleNamespace(keep_cut=keep_cut))
    record = keeping_cuts(monitor, lambda step, epoch, state, ledger: calls.append(("record", step)))
    record(4, 0, b"", {PS_CUT: {"step": 4}})
    record(6, 0, b"", {PS_CUT: {"step": 6}})
    assert calls == [("keep", 4), ("keep", 6), ("record", 6)]
    assert keeping_cuts(types.SimpleNamespace(supervisor=object()), print) is print  # a local shard's folder outlives it

    deleted = []
    entries = [types.SimpleNamespace(path=f"ps-cuts/step-{s:06d}") for s in (2, 4, 6, 8, 10)]
    client = types.SimpleNamespace(list_artifacts=lambda run_id, path: entries)
    tracker = types.SimpleNamespace(client=client, run_id="r1")
    store = CutStore(types.SimpleNamespace(tracker=tracker, committed=[4, 8]), str(tmp_path))
    store._repository = lambda: types.SimpleNamespace(delete_artifacts=deleted.append)
    store._retain()
    assert deleted == ["ps-cuts/step-000002", "ps-cuts/step-000006"]


def test_a_shard_pods_create_that_timed_out_is_made_again_and_a_refusal_is_one_line():
    """The API server's answer lost to a timeout: the pod is asked for again, and a 409 then is
    the pod the lost call made. A 403 ends the job in one line at once."""
    import urllib3

    from elastic_step.backends.kubernetes.ps_pods import PsPods
    from elastic_step.errors import ConfigError

    launcher = PsPods.__new__(PsPods)
    launcher.namespace, launcher.timeout_s = "ml", 1.0
    answers = [urllib3.exceptions.ReadTimeoutError(None, "/pods", "timed out"), k8s.ApiException(status=409, reason="Conflict")]
    calls = []

    def create(namespace, body, _request_timeout):
        calls.append(body)
        raise answers.pop(0)

    launcher._create("parameter-server pod p-0", create, "pod")
    assert calls == ["pod", "pod"] and not answers
    with pytest.raises(ConfigError, match=r"^cannot create parameter-server pod p-0 in namespace ml: 403 Forbidden;"):
        launcher._create("parameter-server pod p-0", lambda *a, **k: (_ for _ in ()).throw(k8s.ApiException(403, "Forbidden")), "pod")
    # A 409 on the first try is another pod of that name (a removed shard's, terminating), not the Role.
    with pytest.raises(ConfigError, match=r"p-0 in namespace ml: one of that name still exists .*try again once it is gone$"):
        launcher._create("parameter-server pod p-0", lambda *a, **k: (_ for _ in ()).throw(k8s.ApiException(409, "Conflict")), "pod")


@pytest.fixture(scope="module")
def policed(tmp_path_factory):
    from test_admission_policy import install_policy

    with Cluster(str(tmp_path_factory.mktemp("cluster"))) as c:
        install_policy(c)
        yield c


@pytest.mark.e2e
def test_deploys_admission_policy_admits_a_masters_shard_pods_and_policy_and_no_wider_one(policed, tmp_path, monkeypatch):
    """With the master pod's own token (deploy/rbac's runner, its admission policy installed):
    its shard pods and their NetworkPolicy pass (server-side dry runs); a -ps policy that
    selects other pods than the job's shards is refused."""
    from test_admission_policy import master_pod as runner_pod
    from test_admission_policy import runner_backend

    cluster, ns = policed, policed.namespace
    master, token = runner_pod(cluster, "train-step-ps")
    backend = runner_backend(cluster, tmp_path, monkeypatch, "ctr", PodSettings(namespace=ns, image=None), master, token)
    try:
        api, networking = cluster.core(token), k8s.NetworkingV1Api(cluster.core(token).api_client)
        pod = ps_pod(backend.settings, backend.names, master, backend.image, 0, '{"tables": []}')
        api.create_namespaced_pod(ns, pod, dry_run="All")
        policy = ps_network_policy(backend.names, master, ns, backend.master_labels, 2)
        networking.create_namespaced_network_policy(ns, policy, dry_run="All")
        policy.spec.pod_selector.match_labels = backend.names.worker_labels  # opening the job's workers instead
        with pytest.raises(k8s.ApiException) as refused:
            networking.create_namespaced_network_policy(ns, policy, dry_run="All")
        assert refused.value.status == 403 and "parameter-server pods" in refused.value.body
    finally:
        backend.shutdown(grace_s=0)


# -- end to end ----------------------------------------------------------------------------------
@pytest.fixture
def clicks(tmp_path) -> str:
    return synthetic_clicks(tmp_path / "ctr", rows=6000, seed=5, rows_per_shard=ROWS_PER_SHARD)


COUNTERS = r"""
import json, sys
from collections import Counter
import numpy as np
from elastic_step.ps.client import PsClient

token, endpoints = open(sys.argv[1]).read().strip(), sys.argv[2:]
client, counts = PsClient(token, lambda: None, timeout_s=10.0), Counter()
for endpoint in endpoints:
    header, body = client.call(endpoint, {"op": "counters", "table": "deepfm_ids"})
    ids = np.frombuffer(body, "<i8", count=header["count"])
    updates = np.frombuffer(body, "<u4", offset=8 * header["count"])
    counts.update({i: u for i, u in zip(ids.tolist(), updates.tolist()) if u})
print(json.dumps(counts))
"""


def in_pod_network(cluster, pod: str, script: str, *args: str) -> str:
    """Run a Python script on the node in the pod's own network namespace (what a process of
    that pod reaches, its policies applied): its output."""
    import subprocess
    import sys

    net = cluster.network.pods[cluster.core().read_namespaced_pod(pod, cluster.namespace).metadata.uid]
    done = subprocess.run([*net.enter(), sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def with_shared_tracking(pod: k8s.V1Pod, folder) -> k8s.V1Pod:
    """The master pod with its MLflow store (SQLite, artifacts beside it) in a folder of the node
    that outlives the pod: what a tracking server is to a step's retry (shard pods never see it)."""
    folder.mkdir(exist_ok=True)
    folder.chmod(0o777)
    container = pod.spec.containers[0]
    container.env = [e for e in container.env if e.name != "MLFLOW_TRACKING_URI"] + [
        k8s.V1EnvVar(name="MLFLOW_TRACKING_URI", value="sqlite:////mlflow/mlflow.db")]
    container.volume_mounts.append(k8s.V1VolumeMount(name="mlflow", mount_path="/mlflow"))
    pod.spec.volumes.append(k8s.V1Volume(name="mlflow", host_path=k8s.V1HostPathVolumeSource(path=str(folder), type="Directory")))
    return pod


def committed_checkpoint(folder) -> int:
    """The newest checkpoint step the run committed (its tag), 0 before any."""
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(f"file:{folder / 'mlflow.db'}?mode=ro", uri=True, timeout=10)) as db:
            rows = db.execute("SELECT value FROM tags WHERE key = 'elastic_step.checkpoint'").fetchall()
    except sqlite3.Error:  # not created yet, or being written
        return 0
    return max((int(v) for (v,) in rows), default=0)


def checkpoint_after(folder, step: int, master, timeout_s: float = 120) -> int:
    """The step of the first checkpoint the run commits after `step` (0: any), waited for."""
    deadline = time.monotonic() + timeout_s
    while (committed := committed_checkpoint(folder)) <= step:
        assert time.monotonic() < deadline, master.log()
        time.sleep(0.05)
    return committed


def scale_ps(master, shards: int) -> dict:
    """`scale --ps` through the master's API (what the CLI sends): what moved."""
    import httpx

    from elastic_step.protocol import API

    with open(master.path(f"{JOB_DIR}/master.json")) as f:
        info = json.load(f)
    with open(master.path(info["token_file"])) as f:
        token = f.read().strip()
    reply = httpx.post(master.reach(info["url"]) + API + "/scale-ps", json={"shards": shards},
                       headers={"Authorization": f"Bearer {token}"}, timeout=240)
    assert reply.status_code == 200, reply.text
    return reply.json()["ps_scale"]


def cut_digest(folder, step: int, shard: int, routing) -> str:
    """The table hash of a shard's cut of `step` as the run's artifacts hold it: its snapshot
    loaded and its ledger replayed, as a shard of `routing` does, in a folder of this test's."""
    import shutil

    from elastic_step.master.ps_tables import table_specs
    from elastic_step.ps.state import LEDGER_FILE, SNAPSHOT_FILE, ShardState

    (kept,) = folder.glob(f"mlartifacts/**/artifacts/ps-cuts/step-{step:06d}")
    replay = folder / f"replay-{step}-{shard}"
    replay.mkdir()
    shutil.copy(kept / f"shard-{shard}.bin", replay / SNAPSHOT_FILE)
    shutil.copy(kept / f"shard-{shard}.ledger", replay / LEDGER_FILE)
    state = ShardState(str(replay), table_specs(DEEPFM_PS), shard, routing)
    state.recover()
    digest = state.tables["deepfm_ids"].digest()
    state.close()
    return digest


@pytest.mark.e2e
def test_a_ps_job_on_shard_pods_keeps_every_update_exactly_once_through_a_shard_pod_sigkill_and_a_master_sigkill(tmp_path, clicks):
    """First `scale --ps 3` adds a shard pod. Then the master: once the run has committed a
    checkpoint of the three shards its container is SIGKILLed, and a new master pod runs the same
    command with --resume (the failed pod and its pods are deleted at the end): its three new
    shard pods each start from exactly their cut of the checkpoint (the table hash of the cut the
    run's artifacts hold). Then one shard pod of the resumed job is SIGKILLed, and, after a later
    checkpoint, another shard's pod is deleted: the job goes back to that checkpoint in process (a
    RESTORED event names it)."""
    tracking = tmp_path / "mlflow"
    with S3Server() as s3, pod_network_cluster(tmp_path, images={TEST_IMAGE: venv_image(TEST_IMAGE)}) as cluster:
        print(f"kubelet runtime: {cluster.kubelet.mode}")
        data = upload(s3.endpoint, clicks, "training-data", "ctr")
        args = ["--backend", "kubernetes", "--data", data, "--storage-option", f"endpoint_url={cluster.pod_url(s3.endpoint)}",
                "--model-def", DEEPFM_PS, "--mode", "ps", "--ps-shards", "2", "--job-dir", JOB_DIR, "--workers", "2",
                "--epochs", str(EPOCHS), "--minibatch-size", str(MINIBATCH), "--minibatches-per-task", "2",
                "--checkpoint-steps", "4", "--worker-cpu", "500m", "--worker-memory", "1Gi", "--max-relaunches", "0",
                "--ps-table-limit-mb", "0", "--no-progress"]
        ns, api = cluster.namespace, cluster.core()
        store_secret(api, ns)
        api.create_namespaced_pod(ns, with_shared_tracking(master_pod(cluster, "train-step-ps", args), tracking))
        api.create_namespaced_pod(ns, python_pod(cluster, "stranger", "import time; time.sleep(600)", []))
        master = MasterOnPodNetwork(cluster, "train-step-ps")
        started = time.monotonic()
        expected = counters_from_the_data(clicks, EPOCHS, MINIBATCH)  # while the pods start
        # scale --ps 3 once the shards hold rows (a first checkpoint committed): a third shard pod,
        # and only the virtual shards that change owner move.
        master.wait(lambda s: s["state"] == "running", timeout=240)
        checkpoint_after(tracking, 0, master)
        moved = scale_ps(master, 3)
        assert 0 < moved["rows_moved"] <= (1 / 3 + 0.05) * moved["rows_total"], moved
        scaled = master.status()["step"]
        # The first master dies outright (SIGKILL) once the run has committed a checkpoint of the three shards, mid-training.
        checkpoint_after(tracking, scaled, master)
        cluster.kubelet.kill(ns, "train-step-ps")
        step = committed_checkpoint(tracking)
        print(f"master SIGKILLed {time.monotonic() - started:.1f}s after it started, its checkpoint of step {step} committed")
        # A retry's new pod, as Argo makes one: the failed pod stays, and so do its pods until it is deleted.
        killed = {p["metadata"]["name"] for p in cluster.pods()}
        api.create_namespaced_pod(ns, with_shared_tracking(master_pod(cluster, "train-step-ps2", [*args, "--resume"]), tracking))
        master = MasterOnPodNetwork(cluster, "train-step-ps2")
        status = master.wait(lambda s: s["state"] == "running" and s["world_size"] == 2, timeout=240)
        print(f"resumed on 2 worker pods and 3 new shard pods after {time.monotonic() - started:.1f}s")
        with open(master.path(f"{JOB_DIR}/logs/master.log")) as f:
            restored = re.findall(r"shard (\d) starts from its cut of step (\d+): table deepfm_ids digest (\w+)", f.read())
        # The command says --ps-shards 2; the checkpoint's routing has three: a resume runs the routing it goes back to.
        scaled_routing = RoutingTable.initial(2).resized(3)  # what scale --ps 3 made of the first two
        assert sorted(restored) == [(str(i), str(step), cut_digest(tracking, step, i, scaled_routing)) for i in range(3)], restored
        endpoints = [s["address"] for s in status["ps_shards"]]
        shard_pods = sorted(p["metadata"]["name"] for p in cluster.pods() if p["metadata"]["name"] not in killed
                            and p["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "ps")
        assert len(endpoints) == len(shard_pods) == 3 and shard_pods[0].endswith("-ps-0"), shard_pods
        cluster.kubelet.kill(ns, shard_pods[0])  # docker kill: the shard's container dies with SIGKILL
        # A pod of the namespace without the job's labels: the shards' policy drops its connections.
        seen = json.loads(in_pod_network(cluster, "stranger", PROBE, *endpoints).strip().splitlines()[-1])
        assert {seen[e] for e in endpoints} == {"timeout"}, seen
        status = master.wait(lambda s: s["ps_shards"][0]["relaunches"] == 1 and s["ps_shards"][0]["state"] == "serving", timeout=120)
        assert status["ps_shards"][0]["address"] == endpoints[0]  # back in its pod, at its address, from its folder

        # Shard 1's pod deleted (its emptyDir, its rows with it) once a checkpoint of the three shards is committed:
        # the job goes back to its newest checkpoint in process, shard 1 in a new pod from its cut, no worker restarts.
        relaunched = status["step"]
        checkpoint_after(tracking, relaunched, master)
        assert master.status()["rows_done"] < master.status()["rows_total"], "every row was trained before the pod deletion"
        api.delete_namespaced_pod(shard_pods[1], ns)
        status = master.wait(lambda s: s["ps_shards"][1]["relaunches"] == 1 and s["ps_shards"][1]["state"] == "serving",
                             timeout=240)  # made anew (its address may be the old one's, freed)
        endpoints = [s["address"] for s in status["ps_shards"]]
        print(f"shard pod {shard_pods[1]} deleted and made anew after {time.monotonic() - started:.1f}s")

        # Every row trained, the master still evaluating: the shards hold every update, each once.
        master.wait(lambda s: s["rows_done"] == s["rows_total"], timeout=300)
        counted = json.loads(in_pod_network(cluster, "train-step-ps2", COUNTERS, master.path(f"{JOB_DIR}/token"), *endpoints))
        got = Counter({int(i): n for i, n in counted.items()})
        wrong = {i: (got[i], expected[i]) for i in set(got) | set(expected) if got[i] != expected[i]}
        assert not wrong, f"{len(wrong)} rows updated other than once per minibatch, e.g. {list(wrong.items())[:5]}"

        phase = master.wait_ended(300)
        log = master.log()
        assert phase == "Succeeded", log
        api.delete_namespaced_pod("train-step-ps", ns)  # the failed attempt's pod: its pods go with it
        print(f"job done {time.monotonic() - started:.1f}s after it started")
        with open(master.path(f"{JOB_DIR}/events.jsonl")) as f:
            events = [json.loads(line) for line in f]
        assert not [e for e in events if e["event"] in ("died", "relaunched")], events  # no worker restarted
        (back,) = [e for e in events if e["event"] == "restored"]
        assert back["step"] > relaunched and "shard 1's pod was deleted" in back["message"], back
        assert f"checkpoint of step {back['step']}" in back["message"], back
        # --ps-table-limit-mb 0: the master copied each shard pod's last snapshot over the shard
        # protocol and evaluated the model looking its rows up in them (the run's pyfunc serves them).
        with open(master.path(f"{JOB_DIR}/model/ps_shards/manifest.json")) as f:
            assert len(json.load(f)["files"]) == 3, "one snapshot from each of the three shard pods"
        with open(master.path(f"{JOB_DIR}/result.json")) as f:
            assert json.load(f)["test_metrics"]["auc"] > 0.6  # the trained rows, from the shards' snapshots

        restarted = [e[4] for e in cluster.server.store.history if e[1] == "pods" and e[4]["metadata"]["name"] == shard_pods[0]]
        assert max(s.get("restartCount", 0) for p in restarted for s in p.get("status", {}).get("containerStatuses", [])) == 1
        instances = {e[4]["metadata"]["labels"]["app.kubernetes.io/instance"] for e in cluster.server.store.history
                     if e[1] == "pods" and e[4]["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "ps"}
        policies = {e[4]["metadata"]["name"]: e[4] for e in cluster.server.store.history if e[1] == "networkpolicies"}
        assert len(instances) == 2 and all(f"{instance}-ps" in policies for instance in instances), (instances, list(policies))
        mine = lambda o: o["metadata"].get("labels", {}).get("app.kubernetes.io/instance") in instances  # noqa: E731
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and [p for p in cluster.pods() if mine(p)]:
            time.sleep(0.5)
        left = [o["metadata"]["name"] for plural in ("pods", "secrets", "networkpolicies") for o in cluster.objects(plural) if mine(o)]
        assert left == []
        assert cluster.refused() == set()  # deploy/'s Role and admission policy allow every call
