"""The backend against the fake CoreV1Api (tests/kube_fake.py), without a master: what the
cluster does to pods (evict, preempt, a deletion during a watch gap) becomes WorkerExits with
the right relaunch policy, and shutdown leaves nothing behind; what the backend asks of the
cluster (image, owner, service account, NetworkPolicies) and that a stalled API server never
holds up its caller."""

from __future__ import annotations

import time

import pytest

from elastic_step.backends.api import LaunchSpec
from elastic_step.backends.kubernetes.backend import KubernetesBackend
from elastic_step.backends.kubernetes.manifests import to_dict
from elastic_step.backends.kubernetes.options import MasterPod, PodSettings
from elastic_step.errors import ConfigError, ElasticStepError

from kube_fake import FakeCoreV1Api


def exits_until(backend, count, timeout=30.0):
    exits, deadline = [], time.monotonic() + timeout
    while len(exits) < count and time.monotonic() < deadline:
        exits += backend.poll()
        time.sleep(0.05)
    return {e.worker_id: e for e in exits}


def running_backend(tmp_path, fake) -> KubernetesBackend:
    """A backend whose worker pods run (as processes of the fake cluster) for master pod `m`. The
    master URL leads nowhere: these workers only need to be running processes."""
    token = tmp_path / "token"
    token.write_text("s3cret")
    spec = LaunchSpec("http://127.0.0.1:9", str(token), str(tmp_path), {"ELASTIC_STEP_TEST": "1"})
    pod = fake.add_master_pod("m", "img:1")
    return KubernetesBackend(spec, PodSettings(namespace="ml", image="img:1"), "unit", api=fake,
                             master=MasterPod("m", pod.metadata.uid, "127.0.0.1", "ml"), watch_timeout_s=5)


def test_a_pod_someone_else_deletes_gracefully_is_reported_once_its_worker_left_and_keeps_its_grace(tmp_path):
    # A drain, an eviction or `kubectl delete pod` deletes a worker's pod with a grace period: the
    # kubelet SIGTERMs the worker, which leaves. The master hears of it only once the worker's
    # process has ended (a worker reported gone must not talk to it any more), takes the slot
    # back as a departure (a free relaunch), and never deletes the pod again with grace 0, which
    # would SIGKILL the worker mid-leave.
    fake = FakeCoreV1Api(str(tmp_path / "cluster"))
    try:
        backend = running_backend(tmp_path, fake)
        backend.launch(0, "w0.1")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and backend.describe("w0.1").get("phase") != "Running":
            backend.poll()
            time.sleep(0.05)
        name = backend.pods["w0.1"]
        process = fake.pods[name].proc
        fake.delete_namespaced_pod(name, "ml", grace_period_seconds=30)  # someone else's, graceful
        exits = exits_until(backend, 1, timeout=60)
        assert process.poll() is not None  # reported only once the worker's process had ended
        assert "deleted by someone else" in exits["w0.1"].reason and exits["w0.1"].relaunch == "free"
        backend.poll()
        assert [c for c in fake.calls if c == ("delete_pod", name)] == [("delete_pod", name)]  # only theirs
        backend.shutdown(grace_s=0.5)
    finally:
        fake.close()


def test_evicted_preempted_and_vanished_pods_are_free_relaunches_and_shutdown_cleans_up(tmp_path):
    fake = FakeCoreV1Api(str(tmp_path / "cluster"))
    try:
        backend = running_backend(tmp_path, fake)
        for slot in range(3):
            backend.launch(slot, f"w{slot}.1")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(backend.describe(f"w{s}.1").get("phase") == "Running" for s in range(3)):
            backend.poll()
            time.sleep(0.05)
        assert [backend.describe(f"w{s}.1")["phase"] for s in range(3)] == ["Running"] * 3
        mounted = tmp_path / "cluster" / backend.pods["w0.1"] / "token" / "token"
        assert mounted.read_text() == "s3cret"  # the Secret, as its volume would show it

        fake.evict(backend.pods["w0.1"])
        fake.evict(backend.pods["w1.1"], preempt=True)
        # The evictions must reach the watch before the history is compacted: a pod that goes
        # during a watch gap is known only by its absence from the re-list, so it would read as
        # "deleted by someone else" (still a free relaunch) rather than "evicted".
        exits = exits_until(backend, 2)
        lists_before = len([c for c in fake.calls if c[0] == "list"])
        fake.vanish(backend.pods["w2.1"])
        exits |= exits_until(backend, 1)
        assert set(exits) == {"w0.1", "w1.1", "w2.1"}, exits
        assert "evicted" in exits["w0.1"].reason and exits["w0.1"].relaunch == "free"
        assert "preempted" in exits["w1.1"].reason and exits["w1.1"].relaunch == "free"
        assert "deleted by someone else" in exits["w2.1"].reason and exits["w2.1"].relaunch == "free"
        assert len([c for c in fake.calls if c[0] == "list"]) > lists_before  # learnt from the re-list after 410

        backend.launch(0, "w0.2")
        backend.shutdown(grace_s=0.5)
        assert fake.wait_until_no_worker_pods() == {} and fake.secrets == {}
        assert backend.poll() == []
    finally:
        fake.close()


# ---- who the master is, what workers run and who owns them -------------------------------------

def unit_backend(tmp_path, fake, settings, master=None, **options):
    """A backend whose pods stay Pending (nothing is scheduled): these tests look at what it asks for."""
    fake.unschedulable = "0/3 nodes are available"
    token = tmp_path / "token"
    token.write_text("s3cret")
    spec = LaunchSpec("http://127.0.0.1:9", str(token), str(tmp_path), {}, **options.pop("spec", {}))
    return KubernetesBackend(spec, settings, "unit", api=fake, master=master, watch_timeout_s=5, **options)


@pytest.fixture
def fake(tmp_path):
    api = FakeCoreV1Api(str(tmp_path / "cluster"))
    yield api
    api.close()


@pytest.fixture
def in_step_pod(monkeypatch, fake):
    """The downward API of an Argo step pod (a `wait` container before `main`), without its UID."""
    master = fake.add_master_pod("train-step-1", "registry.example/ml/es:2.0", namespace="ml")
    for name in ("ELASTIC_STEP_IMAGE", "ELASTIC_STEP_POD_UID", "KFP_POD_UID", "KFP_POD_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ELASTIC_STEP_POD_NAME", master.metadata.name)
    monkeypatch.setenv("ELASTIC_STEP_POD_NAMESPACE", "ml")
    monkeypatch.setenv("ELASTIC_STEP_POD_IP", "127.0.0.1")
    return master


def test_workers_run_the_main_containers_image_not_argos_wait_sidecar(tmp_path, fake, in_step_pod):
    backend = unit_backend(tmp_path, fake, PodSettings(namespace="ml", image=None))
    backend.launch(0, "w0.1")
    backend.shutdown(grace_s=0)
    assert backend.image == "registry.example/ml/es:2.0"
    assert [p.spec.containers[0].image for p in fake.created] == ["registry.example/ml/es:2.0"]


def test_worker_requests_not_given_are_the_step_containers_own_and_never_its_limits(tmp_path, fake, in_step_pod):
    """A namespace's ResourceQuota that requires requests admits the workers as it admitted the step:
    without --worker-cpu/--worker-memory they request what `main` requests (not `wait`'s, no limit);
    a flag given wins for its resource."""
    from kubernetes import client as k8s

    main = in_step_pod.spec.containers[1]  # the fake's own pod object: what the backend reads
    main.resources = k8s.V1ResourceRequirements(requests={"cpu": "500m", "memory": "1Gi"}, limits={"memory": "3Gi"})
    in_step_pod.spec.containers[0].resources = k8s.V1ResourceRequirements(requests={"cpu": "10m"})
    for settings, requests, limits in [
            (PodSettings(namespace="ml", image=None), {"cpu": "500m", "memory": "1Gi"}, None),
            (PodSettings(namespace="ml", image=None, cpu_request="2", cpu_limit="4"), {"cpu": "2", "memory": "1Gi"}, {"cpu": "4"})]:
        fake.created.clear()
        backend = unit_backend(tmp_path, fake, settings)
        backend.launch(0, "w0.1")
        backend.shutdown(grace_s=0)
        [pod] = fake.created
        assert (pod.spec.containers[0].resources.requests, pod.spec.containers[0].resources.limits) == (requests, limits)


def test_elastic_step_image_wins_over_the_pods_own(tmp_path, fake, in_step_pod, monkeypatch):
    monkeypatch.setenv("ELASTIC_STEP_IMAGE", "registry.example/ml/es:pinned")
    backend = unit_backend(tmp_path, fake, PodSettings(namespace="ml", image=None))
    backend.shutdown(grace_s=0)
    assert backend.image == "registry.example/ml/es:pinned"


def test_a_master_pod_without_a_main_container_is_a_clear_error(tmp_path, fake, monkeypatch):
    from kubernetes import client as k8s

    fake.add_master_pod("odd-pod", "unused", containers=[k8s.V1Container(name="wait", image="argoexec"),
                                                         k8s.V1Container(name="trainer", image="es:1")])
    monkeypatch.delenv("ELASTIC_STEP_IMAGE", raising=False)
    with pytest.raises(ConfigError) as error:
        unit_backend(tmp_path, fake, PodSettings(namespace="ml", image=None),
                     master=MasterPod("odd-pod", "", "127.0.0.1", "ml"))
    assert "no container named main" in str(error.value) and "--image" in str(error.value)
    assert "ELASTIC_STEP_IMAGE" in str(error.value)
    assert fake.secrets == {} and fake.created == []  # nothing made before the error


def test_with_image_and_no_uid_in_the_env_the_workers_are_still_owned_by_the_master_pod(tmp_path, fake, in_step_pod):
    backend = unit_backend(tmp_path, fake, PodSettings(namespace="ml", image="registry.example/other:1"))
    backend.launch(0, "w0.1")
    backend.calls.wait_idle(5)
    owned = [fake.created[0].metadata, fake.secrets[backend.names.secret].metadata,
             *(p.metadata for p in fake.network_policies.values())]
    backend.shutdown(grace_s=0)
    for meta in owned:
        assert [(r.kind, r.name, r.uid) for r in meta.owner_references] == [("Pod", "train-step-1", in_step_pod.metadata.uid)]


def test_workers_in_another_namespace_are_not_owned_across_it_and_the_master_deletes_them(tmp_path, fake, in_step_pod):
    # No policy can select the master from the workers' namespace: started only when the user opts out.
    backend = unit_backend(tmp_path, fake, PodSettings(namespace="batch", image="registry.example/other:1",
                                                       master_network_policy=False))
    backend.launch(0, "w0.1")
    backend.calls.wait_idle(5)
    made = [fake.created[0].metadata, fake.secrets[backend.names.secret].metadata,
            *(p.metadata for p in fake.network_policies.values())]
    assert all(meta.owner_references is None for meta in made)
    backend.shutdown(grace_s=0)
    assert fake.wait_until_no_worker_pods() == {} and fake.secrets == {} and fake.network_policies == {}


# ---- workers' identity, the job's NetworkPolicies -----------------------------------------------

def test_workers_get_their_own_service_account_with_no_token_and_never_the_masters(tmp_path, fake, in_step_pod):
    backend = unit_backend(tmp_path, fake, PodSettings(namespace="ml", image="es:1"))
    backend.launch(0, "w0.1")
    backend.shutdown(grace_s=0)
    spec = fake.created[0].spec
    assert spec.service_account_name == "elastic-step-worker" and spec.automount_service_account_token is False
    with pytest.raises(ConfigError) as error:
        unit_backend(tmp_path, fake, PodSettings(namespace="ml", image="es:1", service_account="elastic-step-runner"))
    assert "--service-account elastic-step-runner" in str(error.value) and "elastic-step-worker" in str(error.value)


def test_the_job_network_policies_admit_only_its_own_workers_and_go_with_it(tmp_path, fake, in_step_pod):
    import kubernetes_validate

    backend = unit_backend(tmp_path, fake, PodSettings(namespace="ml", image="es:1"), spec={"master_ports": [9, 29500]})
    policies = {name: to_dict(p) for name, p in fake.network_policies.items()}
    backend.launch(0, "w0.1")
    backend.calls.wait_idle(5)
    worker_labels = fake.created[0].metadata.labels
    backend.shutdown(grace_s=0)
    assert sorted(policies) == [f"{backend.names.instance}-master", f"{backend.names.instance}-workers"]
    for policy in policies.values():
        kubernetes_validate.validate(policy, kubernetes_validate.utils.latest_version(), strict=True)
    workers = policies[f"{backend.names.instance}-workers"]["spec"]
    job_workers = {"app.kubernetes.io/instance": backend.names.instance, "app.kubernetes.io/component": "worker"}
    assert workers["podSelector"]["matchLabels"] == job_workers
    assert workers["ingress"] == [{"from": [{"podSelector": {"matchLabels": job_workers}}]}]  # gloo: any port
    assert job_workers.items() <= worker_labels.items()
    master = policies[f"{backend.names.instance}-master"]["spec"]
    # The master's own pod, by its labels (not the one that flips when the workflow completes).
    assert master["podSelector"]["matchLabels"] == {"workflows.argoproj.io/workflow": "train-wf"}
    assert master["ingress"] == [{"from": [{"podSelector": {"matchLabels": job_workers}}],
                                  "ports": [{"port": 9, "protocol": "TCP"}, {"port": 29500, "protocol": "TCP"}]}]
    assert master["policyTypes"] == workers["policyTypes"] == ["Ingress"]
    assert fake.network_policies == {}
    assert ("delete_network_policy", f"{backend.names.instance}-master") in fake.calls


@pytest.mark.parametrize("case", ["unreadable pod", "unlabelled pod", "workers elsewhere", "outside a pod"])
def test_a_job_whose_master_no_policy_can_select_is_refused_unless_the_user_opts_out(tmp_path, fake, monkeypatch,
                                                                                     caplog, case):
    """The master's port (its API and the token-less rendezvous store) is closed by the master's
    own NetworkPolicy, which selects its pod by the pod's labels in the workers' namespace."""
    for name in ("ELASTIC_STEP_POD_NAME", "KFP_POD_NAME", "ELASTIC_STEP_POD_UID", "KFP_POD_UID"):
        monkeypatch.delenv(name, raising=False)
    fake.add_master_pod("step", "es:1")
    master, namespace, url = MasterPod("step", "", "127.0.0.1", "ml"), "ml", {}
    if case == "unreadable pod":
        master = MasterPod("gone", "", "127.0.0.1", "ml")
    elif case == "unlabelled pod":  # only the label that changes during the pod's life
        fake.pods["step"].pod.metadata.labels = {"workflows.argoproj.io/completed": "false"}
    elif case == "workers elsewhere":
        namespace = "batch"
    else:  # on a laptop or a VM, the workers calling it at an address they reach
        master, url = None, {"master_url": "http://10.1.2.3:9"}
    made_before = (set(fake.secrets), set(fake.network_policies))
    with pytest.raises(ConfigError) as refused:
        KubernetesBackend(LaunchSpec(url.get("master_url", "http://127.0.0.1:9"), str(tmp_path / "token"), str(tmp_path)),
                          PodSettings(namespace=namespace, image="es:1"), "unit", api=fake, master=master)
    message = str(refused.value)
    assert "\n" not in message and "master's NetworkPolicy cannot be made" in message
    assert "--no-master-network-policy" in message and (set(fake.secrets), set(fake.network_policies)) == made_before
    # The explicit opt-out: it starts, says so, and still closes what it can (the workers' policy).
    (tmp_path / "token").write_text("s3cret")
    backend = KubernetesBackend(LaunchSpec(url.get("master_url", "http://127.0.0.1:9"), str(tmp_path / "token"),
                                           str(tmp_path)),
                                PodSettings(namespace=namespace, image="es:1", master_network_policy=False), "unit",
                                api=fake, master=master)
    assert backend.network_policies == [f"{backend.names.instance}-workers"]
    assert any("--no-master-network-policy: the master pod is open" in r.getMessage() for r in caplog.records)
    backend.shutdown(grace_s=0)


def test_the_opt_out_is_a_train_flag_and_off_by_default(tmp_path):
    from elastic_step.backends.kubernetes.options import settings_from_config
    from elastic_step.cli import build_parser
    from elastic_step.cli.train import train_config

    parser = build_parser()
    common = ["train", "--backend", "kubernetes", "--model-def", "m", "--data", "s3://b/d", "--job-dir", str(tmp_path / "j")]
    assert settings_from_config(train_config(parser.parse_args(common))).master_network_policy is True
    opted = train_config(parser.parse_args([*common, "--no-master-network-policy"]))
    assert settings_from_config(opted).master_network_policy is False


# ---- a stalled API server never holds the master up -----------------------------------------------

def test_a_stalled_api_server_blocks_no_caller_and_every_call_has_a_timeout(tmp_path, fake, in_step_pod):
    backend = unit_backend(tmp_path, fake, PodSettings(namespace="ml", image="es:1"), request_timeout_s=1.0)
    fake.stall_s = 30.0  # far longer than any worker's master timeout
    started = time.monotonic()
    for slot in range(3):
        backend.launch(slot, f"w{slot}.1")  # the master holds its lock around these
    backend.stop("w0.1")
    backend.poll()
    backend.describe("w1.1")
    assert time.monotonic() - started < 0.5
    # Each stalled create ends at its request timeout and comes back as a counted exit.
    exits = exits_until(backend, 3, timeout=15)
    assert set(exits) == {"w0.1", "w1.1", "w2.1"}, exits  # w0.1 was stopped, but never created either
    assert all("not created" in e.reason and e.relaunch == "count" for e in exits.values())
    fake.stall_s = 0
    backend.shutdown(grace_s=0)
    untimed = [call for call, timeout in fake.request_timeouts if not timeout]
    assert not untimed, untimed
    assert {"create_pod", "delete_pod", "read_pod", "list", "watch", "create_secret", "delete_secret",
            "create_network_policy", "delete_network_policy"} <= {call for call, _ in fake.request_timeouts}


def test_workers_take_the_store_credentials_from_the_masters_secrets_by_reference_only(tmp_path, fake, monkeypatch):
    from kubernetes import client as k8s

    def from_secret(name, secret, key):
        return k8s.V1EnvVar(name=name, value_from=k8s.V1EnvVarSource(
            secret_key_ref=k8s.V1SecretKeySelector(name=secret, key=key)))

    main = k8s.V1Container(name="main", image="es:1", env=[
        from_secret("AWS_ACCESS_KEY_ID", "store-credentials", "accesskey"),
        from_secret("AWS_SECRET_ACCESS_KEY", "store-credentials", "secretkey"),
        from_secret("MLFLOW_TRACKING_PASSWORD", "mlflow-pipelines", "password"),  # workers never talk to MLflow
        k8s.V1EnvVar(name="AWS_SESSION_TOKEN", value="a-literal"),  # never copied into another pod's spec
    ])
    fake.add_master_pod("step", "es:1", containers=[k8s.V1Container(name="wait", image="argoexec"), main])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "from-the-secret")  # as the kubelet sets it in the master's container
    master = MasterPod("step", "", "127.0.0.1", "ml")
    backend = unit_backend(tmp_path, fake, PodSettings(namespace="ml", image=None), master=master)
    backend.launch(0, "w0.1")
    backend.shutdown(grace_s=0)
    env = {e.name: e for e in fake.created[0].spec.containers[0].env}
    assert env["AWS_ACCESS_KEY_ID"].value_from.secret_key_ref.to_dict() == {"name": "store-credentials", "key": "accesskey", "optional": None}
    assert env["AWS_SECRET_ACCESS_KEY"].value is None and env["AWS_SECRET_ACCESS_KEY"].value_from.secret_key_ref.key == "secretkey"
    assert "MLFLOW_TRACKING_PASSWORD" not in env and "AWS_SESSION_TOKEN" not in env
    elsewhere = unit_backend(tmp_path, fake, PodSettings(namespace="batch", image=None, master_network_policy=False),
                             master=MasterPod("step", "", "127.0.0.1", "ml"))
    elsewhere.launch(0, "w0.1")
    elsewhere.shutdown(grace_s=0)
    assert "AWS_ACCESS_KEY_ID" not in {e.name for e in fake.created[-1].spec.containers[0].env}  # a Secret stays in its namespace


@pytest.mark.parametrize("named", [None, "digits-reader", "mlpipeline-minio-artifact"])
def test_worker_pods_never_hold_kfps_whole_store_secret_unless_it_is_named(tmp_path, fake, caplog, named):
    """The shipped KFP pipelines give the master KFP's own MinIO Secret (read and write on every
    run's artifacts); its workers run user code, so they read the data with a per-dataset Secret."""
    from kubernetes import client as k8s

    kfp_key = lambda var, key: k8s.V1EnvVar(name=var, value_from=k8s.V1EnvVarSource(  # noqa: E731
        secret_key_ref=k8s.V1SecretKeySelector(name="mlpipeline-minio-artifact", key=key, optional=True)))
    main = k8s.V1Container(name="main", image="es:1", env=[kfp_key("AWS_ACCESS_KEY_ID", "accesskey"),
                                                           kfp_key("AWS_SECRET_ACCESS_KEY", "secretkey")])
    fake.add_master_pod("step", "es:1", containers=[main])
    backend = unit_backend(tmp_path, fake, PodSettings(namespace="ml", image=None, worker_store_secret=named),
                           master=MasterPod("step", "", "127.0.0.1", "ml"))
    backend.launch(0, "w0.1")
    backend.shutdown(grace_s=0)
    env = {e.name: e.value_from.secret_key_ref for e in fake.created[0].spec.containers[0].env if e.value_from}
    secret, keys = {None: ("elastic-step-data-reader", ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")),
                    "digits-reader": ("digits-reader", ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")),
                    "mlpipeline-minio-artifact": ("mlpipeline-minio-artifact", ("accesskey", "secretkey"))}[named]
    assert {var: (ref.name, ref.key) for var, ref in env.items()} == {
        "AWS_ACCESS_KEY_ID": (secret, keys[0]), "AWS_SECRET_ACCESS_KEY": (secret, keys[1])}
    warned = [r.getMessage() for r in caplog.records if "not those of KFP's" in r.getMessage()]
    assert len(warned) == (1 if named is None else 0)


def test_the_worker_store_secret_comes_from_the_flag_or_the_env_and_is_checked(tmp_path, monkeypatch):
    from elastic_step.backends.kubernetes.options import settings_from_config
    from elastic_step.cli import build_parser
    from elastic_step.cli.train import train_config

    common = ["train", "--backend", "kubernetes", "--model-def", "m", "--data", "s3://b/d", "--job-dir", str(tmp_path / "j")]
    settings = lambda *extra: settings_from_config(train_config(build_parser().parse_args([*common, *extra])))  # noqa: E731
    monkeypatch.delenv("ELASTIC_STEP_WORKER_STORE_SECRET", raising=False)
    assert settings().worker_store_secret is None
    assert settings("--worker-store-secret", "digits-reader").worker_store_secret == "digits-reader"
    monkeypatch.setenv("ELASTIC_STEP_WORKER_STORE_SECRET", "team-reader")  # what a KFP task can set
    assert settings().worker_store_secret == "team-reader"
    with pytest.raises(ConfigError, match="--store-secret 'Team_Reader' is not a Secret name"):
        settings("--store-secret", "Team_Reader")


# ---- the status others read: a ConfigMap the master keeps, and the stop request on it --------------

def test_the_status_configmap_is_created_then_updated_carries_a_stop_request_and_goes_with_the_job(tmp_path, fake):
    import json

    from elastic_step.backends.kubernetes.manifests import STATUS_KEY, STOP_ANNOTATION

    pod = fake.add_master_pod("train-step-1", "es:1")
    master = MasterPod("train-step-1", pod.metadata.uid, "127.0.0.1", "ml")
    backend = unit_backend(tmp_path, fake, PodSettings(namespace="ml", image="es:1"), master=master, request_timeout_s=1.0)
    name = backend.names.status_map
    assert backend.publish({"status": {"state": "running", "step": 1}}) == {}
    made = fake.config_maps[name]
    assert made.metadata.labels["app.kubernetes.io/component"] == "status"
    assert made.metadata.labels["app.kubernetes.io/instance"] == backend.names.instance
    assert [(o.kind, o.name, o.uid) for o in made.metadata.owner_references] == [("Pod", "train-step-1", pod.metadata.uid)]
    assert backend.publish({"status": {"state": "running", "step": 2}}) == {}
    assert json.loads(fake.config_maps[name].data[STATUS_KEY])["status"]["step"] == 2
    assert [c for c in fake.calls if c[1] == name] == [("create_config_map", name), ("patch_config_map", name)]
    # `elastic-step stop --backend kubernetes` leaves an annotation; the next publish finds it.
    fake.patch_namespaced_config_map(name, "ml", {"metadata": {"annotations": {STOP_ANNOTATION: "now"}}})
    assert backend.publish({"status": {"state": "running", "step": 3}}).keys() == {"stop"}
    # A stalled API server costs stale status, not the job: publish returns at its timeout.
    fake.stall_s = 30.0
    fake.patch_namespaced_config_map = lambda *a, **kw: fake._timed("patch_config_map", kw, stalls=True)
    started = time.monotonic()
    assert backend.publish({"status": {"state": "running", "step": 4}}) == {}
    assert time.monotonic() - started < 5
    fake.stall_s = 0
    backend.shutdown(grace_s=0)
    assert name not in fake.config_maps
    assert backend.publish({"status": {"state": "succeeded"}}) == {} and name not in fake.config_maps  # nothing outlives the job


def test_the_cli_reads_a_published_job_and_asks_it_to_stop(tmp_path, fake):
    from elastic_step.backends.kubernetes.manifests import STOP_ANNOTATION
    from elastic_step.operate.statusmap import kubernetes_view, status_map

    pod = fake.add_master_pod("train-step-1", "es:1")  # the CLI checks the status is its master's own
    backend = unit_backend(tmp_path, fake, PodSettings(namespace="ml", image="es:1"),
                           master=MasterPod("train-step-1", pod.metadata.uid, "127.0.0.1", "ml"))
    status = {"job": "unit", "state": "running", "round": 2, "world_size": 2, "target_workers": 2, "workers_range": [1, 2],
              "epoch": 0, "epochs": 3, "rows_done": 50, "rows_total": 300, "step": 7, "loss": 0.5, "samples_per_s": 120.0,
              "workers": [{"id": "w0.1", "slot": 0, "rank": 0, "state": "live", "pod": "p0", "step": 7, "last_seen": time.time()},
                          {"id": "w1.1", "slot": 1, "state": "gone", "exit": "killed by SIGKILL"},
                          {"id": "w1.2", "slot": 1, "rank": 1, "state": "live", "pod": "p1", "step": 7, "last_seen": time.time()}]}
    events = [{"time": 1.0, "event": "died", "worker": "w1.1", "reason": "killed by SIGKILL"},
              {"time": 2.0, "event": "relaunched", "worker": "w1.2"}, {"time": 3.0, "event": "checkpoint", "step": 5}]
    backend.publish({"info": {"job": "unit", "backend": "kubernetes", "mlflow": {"run_id": "r1"}}, "status": status, "events": events})
    view = kubernetes_view("unit", "ml", with_events=True, api=fake)
    summary = view["summary"]
    assert (summary["state"], summary["epoch"], summary["rows_done"], summary["checkpoints"]) == ("running", 1, 50, [5])
    assert summary["job_dir"] == "pod ml/train-step-1"
    assert "mlflow artifacts download -r r1 -a tensorboard" in summary["tensorboard"]
    assert [(w["id"], w["relaunches"], w["relaunch_causes"]) for w in view["workers"]] == [
        ("w0.1", 0, []), ("w1.2", 1, ["killed by SIGKILL"])]
    assert [e["event"] for e in view["events"]] == ["died", "relaunched", "checkpoint"]
    with pytest.raises(ElasticStepError, match="no running job 'nope' in namespace ml.*--mlflow-uri"):
        kubernetes_view("nope", "ml", api=fake)
    # stop: the annotation lands on the job's ConfigMap (the master's publish takes it from there).
    from elastic_step.operate.statusmap import stop_kubernetes

    assert "asked job unit to stop" in stop_kubernetes("unit", "ml", 5, wait=False, api=fake)
    assert STOP_ANNOTATION in status_map(fake, "ml", "unit").metadata.annotations
    backend.shutdown(grace_s=0)
