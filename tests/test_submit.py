"""`elastic-step submit` and `delete` as a person runs them on a laptop: separate processes with a
kubeconfig pointing at the cluster stand-in (tests/cluster: the HTTPS API server with deploy/'s
RBAC, a kubelet running each pod in its own filesystem view). `--dry-run` prints objects the
API would take; each refusal is one line, exit 2, with nothing created; a real submission's
master pod trains on worker pods it creates, reading the data from the tests' S3 server with the
keys of the Secret named on the command line, and `delete` leaves nothing of the job."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import kubernetes_validate
import pytest
import yaml
from kubernetes import client as k8s

from cluster import Cluster
from elastic_step.audit import audit_report
from stores import TEST_KEY_ID, TEST_SECRET, S3Server, upload

pytestmark = pytest.mark.e2e

MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model_zoo", "digits_torch.py")
STORE_SECRET = "training-data-store"
JOB = "digits-submit"


@pytest.fixture
def cluster(tmp_path):
    with Cluster(str(tmp_path / "cluster")) as c:
        print(f"kubelet runtime: {c.kubelet.mode}")
        yield c


# What `submit`, `delete`, `get` and `logs` ask of the API in the job's namespace: a share of
# Kubernetes' `admin` ClusterRole, which a namespace's owner holds (it has no PriorityClass reads).
SUBMITTER_RULES = [
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "create", "delete"]},
    {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list", "create", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list", "delete"]},
    {"apiGroups": [""], "resources": ["serviceaccounts"], "verbs": ["get"]},
    {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["list", "delete"]},
    {"apiGroups": ["authorization.k8s.io"], "resources": ["localsubjectaccessreviews"], "verbs": ["create"]},
]


def kubeconfig(cluster: Cluster, folder, user: str = "admin") -> str:
    """A kubeconfig whose current context is the job's namespace: the cluster's admin, or a
    `user` bound there to SUBMITTER_RULES and nothing else."""
    token = cluster.admin_token
    if user != "admin":
        cluster.authorizer.add_role(cluster.namespace, "submitter", SUBMITTER_RULES)
        cluster.authorizer.add_binding(cluster.namespace, {"kind": "Role", "name": "submitter"}, [{"kind": "User", "name": user}])
        token = cluster.authorizer.issue_token(user)
    return cluster.kubeconfig(folder, user, token)


def elastic_step(config: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "MLFLOW_", "AWS_"))}
    return subprocess.run([sys.executable, "-m", "elastic_step.cli", *args], capture_output=True, text=True,
                          env={**env, "KUBECONFIG": config}, timeout=timeout)


def store_secret(cluster: Cluster, namespace: str | None = None) -> None:
    cluster.core().create_namespaced_secret(namespace or cluster.namespace, k8s.V1Secret(
        metadata=k8s.V1ObjectMeta(name=STORE_SECRET),
        string_data={"AWS_ACCESS_KEY_ID": TEST_KEY_ID, "AWS_SECRET_ACCESS_KEY": TEST_SECRET}))


def job_args(cluster: Cluster, model: str, data: str, *extra: str) -> list[str]:
    return ["submit", "--job-name", JOB, "--image", cluster.project_image, "--model-def", model, "--data", data,
            "--store-secret", STORE_SECRET, *extra]


def everything(cluster: Cluster) -> dict[str, list[str]]:
    return {plural: sorted(f"{o['metadata'].get('namespace')}/{o['metadata']['name']}" for o in cluster.server.objects(plural))
            for plural in ("pods", "configmaps", "secrets", "networkpolicies")}


def test_dry_run_prints_objects_the_api_accepts_pod_security_restricted_and_creates_nothing(tmp_path, cluster):
    config = kubeconfig(cluster, tmp_path)
    before = everything(cluster)
    gpu_image = "registry.example/ml/digits-cuda:1"  # a user's image: its build is its own (the project's are CPU-only)
    done = elastic_step(config, *job_args(cluster, MODEL, "/data/digits", "--volume", "claim=training-data,mount_path=/data",
                                          "--workers", "2:4", "--worker-cpu", "500m:1", "--worker-gpu", "1", "--image", gpu_image,
                                          "--mlflow-uri", "http://mlflow.ml:5000", "--mlflow-secret", "mlflow-user",
                                          "--audit", f"/tmp/{JOB}/audit.jsonl", "--no-shuffle", "--dry-run"))
    assert done.returncode == 0, done.stderr
    assert everything(cluster) == before
    docs = list(yaml.safe_load_all(done.stdout))
    assert [d["kind"] for d in docs] == ["ConfigMap", "Pod"]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30.0", strict=True)
    config_map, pod = docs
    with open(MODEL) as f:
        assert config_map["data"] == {"digits_torch.py": f.read()}
    assert config_map["metadata"]["labels"]["elastic-step/job"] == pod["metadata"]["labels"]["elastic-step/job"] == JOB
    main = pod["spec"]["containers"][0]
    assert main["name"] == "main" and main["image"] == gpu_image
    argv = main["command"] + main["args"]
    assert argv[:2] == ["elastic-step", "train"]
    options = dict(zip(argv, argv[1:]))  # each flag -> the token after it
    assert options["--backend"] == "kubernetes" and options["--job-dir"] == f"/tmp/{JOB}"
    assert options["--model-def"] == "/elastic-step/model-def/digits_torch.py" and options["--data"] == "/data/digits"
    assert options["--workers"] == "2:4" and options["--worker-gpus"] == "1" and "--no-shuffle" in argv
    env = {e["name"]: e for e in main["env"]}
    assert {n: env[n]["valueFrom"]["fieldRef"]["fieldPath"] for n in ("ELASTIC_STEP_POD_NAME", "ELASTIC_STEP_POD_UID",
            "ELASTIC_STEP_POD_NAMESPACE", "ELASTIC_STEP_POD_IP")} == {
        "ELASTIC_STEP_POD_NAME": "metadata.name", "ELASTIC_STEP_POD_UID": "metadata.uid",
        "ELASTIC_STEP_POD_NAMESPACE": "metadata.namespace", "ELASTIC_STEP_POD_IP": "status.podIP"}
    # Every secret by reference, none as a value or an argument.
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {"name": STORE_SECRET, "key": "AWS_SECRET_ACCESS_KEY"}
    assert env["MLFLOW_TRACKING_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "mlflow-user", "key": "password"}
    assert env["MLFLOW_TRACKING_URI"]["value"] == "http://mlflow.ml:5000"
    assert TEST_SECRET not in done.stdout
    # PodSecurity `restricted` (pod-security-admission's checks of that level).
    security, csec = pod["spec"]["securityContext"], main["securityContext"]
    assert security["runAsNonRoot"] is True and security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert csec["allowPrivilegeEscalation"] is False and csec["capabilities"] == {"drop": ["ALL"]}
    assert all(set(v) - {"name"} <= {"configMap", "emptyDir", "persistentVolumeClaim", "secret", "projected"}
               for v in pod["spec"]["volumes"])
    assert pod["spec"]["serviceAccountName"] == "elastic-step-runner"


def test_the_master_gives_its_workers_the_model_definition_and_data_volume_at_the_same_paths(tmp_path):
    """What the master's backend makes of the submitted pod: each worker pod mounts the model's
    ConfigMap and the data claim read-only where the master has them, and nothing else of it."""
    from elastic_step.backends.kubernetes.manifests import JobNames, shared_volumes_of, to_dict, worker_pod
    from elastic_step.backends.kubernetes.options import PodSettings
    from elastic_step.submit.spec import MASTER_ENV, Submission, master_pod, parse_volume
    from elastic_step.argo.steps import MASTER_ENV as ARGO_MASTER_ENV

    assert MASTER_ENV == ARGO_MASTER_ENV
    sub = Submission(job=JOB, namespace="ml", image="img", train_args=[], model_file=MODEL,
                     volumes=[parse_volume("claim=training-data,mount_path=/data", 0)])
    pod = master_pod(sub)
    shared = shared_volumes_of(pod, pod.spec.containers[0], sub.shared_mounts)
    worker = to_dict(worker_pod(PodSettings(namespace="ml", image="img"), JobNames.for_job(JOB), None, "img", "w0.1", 0,
                                "http://10.0.0.1:8080", shared=shared))
    kubernetes_validate.validate(worker, "1.30.0", strict=True)
    volumes = {v["name"]: v for v in worker["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for m in worker["spec"]["containers"][0]["volumeMounts"]}
    assert volumes[mounts["/elastic-step/model-def"]["name"]]["configMap"]["name"] == f"{JOB}-model-def"
    assert volumes[mounts["/data"]["name"]]["persistentVolumeClaim"]["claimName"] == "training-data"
    assert mounts["/data"]["readOnly"] and mounts["/elastic-step/model-def"]["readOnly"]
    assert mounts["/tmp"]["name"] == "scratch" and volumes["scratch"] == {"name": "scratch", "emptyDir": {}}  # its own


@pytest.mark.parametrize("case", ["no-deploy", "no-role", "missing-secret", "model-too-big", "unknown-priority-class"])
def test_submit_refuses_in_one_line_before_creating_anything(tmp_path, cluster, case):
    config = kubeconfig(cluster, tmp_path)
    api = cluster.core()
    store_secret(cluster)
    model, extra, namespace = MODEL, [], cluster.namespace
    if case == "no-deploy":  # a namespace where deploy/ was never applied
        namespace = "other"
        store_secret(cluster, namespace)
    elif case == "no-role":  # the service accounts, but no RoleBinding to the master's Role
        namespace = "other"
        store_secret(cluster, namespace)
        for name in ("elastic-step-runner", "elastic-step-worker"):
            api.create_namespaced_service_account(namespace, k8s.V1ServiceAccount(metadata=k8s.V1ObjectMeta(name=name)))
    elif case == "missing-secret":
        api.delete_namespaced_secret(STORE_SECRET, namespace)
    elif case == "model-too-big":
        model = str(tmp_path / "big_model.py")
        shutil.copy(MODEL, model)
        with open(model, "a") as f:
            f.write("#" + "x" * (1024 * 1024) + "\n")
    elif case == "unknown-priority-class":
        extra = ["--priority-class", "batch-low"]
    before = everything(cluster)
    done = elastic_step(config, *job_args(cluster, model, "s3://training-data/digits", "--namespace", namespace, *extra))
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("elastic-step submit: error: "), done.stderr
    expected = {"no-deploy": "namespace other has no service account elastic-step-runner: apply deploy/",
                "no-role": "service account elastic-step-runner in namespace other may not create configmaps, ",
                "missing-secret": f"--store-secret {STORE_SECRET}: no such Secret in namespace {namespace}",
                "model-too-big": "over a ConfigMap's 1 MiB",
                "unknown-priority-class": "--priority-class batch-low: no such PriorityClass"}[case]
    assert expected in lines[0], lines[0]
    if case == "no-role":
        assert "create pods" in lines[0] and "create networking.k8s.io/networkpolicies" in lines[0]
    assert everything(cluster) == before
    assert done.stdout == ""


def test_a_submitted_job_trains_on_worker_pods_and_delete_leaves_nothing_of_it(tmp_path, digits, cluster):
    """A model definition from a local file (shipped in a ConfigMap to the master and, through
    it, to every worker), data in a private bucket read with the Secret's keys, a known
    PriorityClass: the master pod runs, `get`, `list` and `ui` show it running, its two worker pods
    train to Succeeded with an exact audit, and `delete` removes every object with the job's label."""
    model = str(tmp_path / "my_digits.py")
    shutil.copy(MODEL, model)
    config = kubeconfig(cluster, tmp_path, "carol")  # a namespace owner, not the cluster's admin
    store_secret(cluster)
    k8s.SchedulingV1Api(cluster.core().api_client).create_priority_class(
        k8s.V1PriorityClass(metadata=k8s.V1ObjectMeta(name="batch-low"), value=100))
    epochs = 2
    with S3Server() as s3:
        data = upload(s3.endpoint, digits, "training-data", "digits")
        started = time.monotonic()
        done = elastic_step(config, *job_args(cluster, model, data, "--storage-option", f"endpoint_url={s3.endpoint}",
                                              "--workers", "2", "--epochs", str(epochs), "--minibatch-size", "32",
                                              "--checkpoint-steps", "0", "--worker-memory", "1Gi:2Gi",
                                              "--priority-class", "batch-low", "--audit", f"/tmp/{JOB}/audit.jsonl",
                                              "--no-progress"))
        assert done.returncode == 0, done.stderr
        assert f"job {JOB} submitted" in done.stdout
        # The PriorityClass is not hers to read: said and skipped, the API server judges the pod.
        assert "cannot check PriorityClass batch-low (403" in done.stderr, done.stderr
        for command in ("get", "logs", "top", "stop"):
            assert f"elastic-step {command} {JOB} --backend kubernetes --namespace {cluster.namespace}" in done.stdout
        ns, pod_name = cluster.namespace, f"{JOB}-master"
        # `get` reads the running job by its name, through the API alone (the status its master publishes).
        deadline, view = time.monotonic() + 180, None
        while view is None or view["summary"]["state"] != "running":
            assert time.monotonic() < deadline, (view, cluster.core().read_namespaced_pod_log(pod_name, ns))
            got = elastic_step(config, "get", JOB, "--backend", "kubernetes", "-o", "json")
            view = json.loads(got.stdout) if got.returncode == 0 else None
            time.sleep(0.5)
        assert view["summary"]["job"] == JOB and view["summary"]["job_dir"] == f"pod {ns}/{pod_name}", view["summary"]
        looked = time.monotonic()
        list_and_live_page(config)  # while it runs: its workers and status exist until the master ends
        print(f"list and ui took {time.monotonic() - looked:.1f}s")
        while cluster.core().read_namespaced_pod(pod_name, ns).status.phase not in ("Succeeded", "Failed"):
            assert time.monotonic() < deadline, cluster.core().read_namespaced_pod_log(pod_name, ns)
            time.sleep(0.5)
        log = cluster.core().read_namespaced_pod_log(pod_name, ns)
        assert cluster.core().read_namespaced_pod(pod_name, ns).status.phase == "Succeeded", log
        print(f"job done {time.monotonic() - started:.1f}s after submit")

    scratch = cluster.kubelet.volume_path(ns, pod_name, "scratch")
    report = audit_report(os.path.join(scratch, JOB, "audit.jsonl"), digits, epochs)
    assert report["exact"] and report["rows_applied"] == report["rows_expected"], report
    with open(os.path.join(scratch, JOB, "result.json")) as f:
        assert json.load(f)["test_metrics"]["accuracy"] >= 0.85
    workers = [e[4] for e in cluster.server.store.history if e[1] == "pods" and e[3] == "ADDED"
               and e[4]["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "worker"]
    assert len(workers) == 2
    for pod in workers:
        assert pod["metadata"]["labels"]["elastic-step/job"] == JOB and pod["spec"]["priorityClassName"] == "batch-low"
        mounts = {m["mountPath"]: m["name"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes[mounts["/elastic-step/model-def"]]["configMap"]["name"] == f"{JOB}-model-def"
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {"name": STORE_SECRET, "key": "AWS_SECRET_ACCESS_KEY"}
    assert cluster.refused() == set()  # the master's service account was refused nothing

    logs = elastic_step(config, "logs", JOB, "--backend", "kubernetes", "--master")  # the ended master's log, until `delete`
    assert logs.returncode == 0 and f"rows audited: {report['rows_applied']}" in logs.stdout, logs.stderr

    deleted = elastic_step(config, "delete", JOB)
    assert deleted.returncode == 0, deleted.stderr
    assert f"pod {pod_name}" in deleted.stdout and f"configmap {JOB}-model-def" in deleted.stdout
    left = [f"{plural} {o['metadata']['name']}" for plural in ("pods", "configmaps", "secrets", "networkpolicies")
            for o in cluster.objects(plural) if o["metadata"].get("labels", {}).get("elastic-step/job") == JOB]
    assert left == []
    assert [s["metadata"]["name"] for s in cluster.objects("secrets")] == [STORE_SECRET]  # the user's own stays
    again = elastic_step(config, "delete", JOB)
    assert again.returncode == 2 and f"no job {JOB} in namespace {ns}" in again.stderr
    assert cluster.refused("carol") == {("get", "priorityclasses", "")}  # submit, get, logs, delete: her Role sufficed


def list_and_live_page(config: str) -> None:
    """`list` and `ui --backend kubernetes` on the submitted job, with the submitter's own
    kubeconfig: the job among the namespace's, and its live page served on this machine's
    loopback from the status its master publishes (the page's data behind the printed token)."""
    import httpx

    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "MLFLOW_", "AWS_"))}, "KUBECONFIG": config}
    server = subprocess.Popen([sys.executable, "-m", "elastic_step.cli", "ui", JOB, "--backend", "kubernetes"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        listed = elastic_step(config, "list", "--backend", "kubernetes", "-o", "json")  # while `ui` starts
        assert listed.returncode == 0, listed.stderr
        row = next(r for r in json.loads(listed.stdout) if r["job"] == JOB)
        assert row["state"] == "running" and row["epochs"] == 2 and row["target_workers"] == 2, row
        line = server.stdout.readline()
        assert f"live page of job {JOB} (pod " in line, (line, server.stderr.read() if server.poll() is not None else "")
        url = line.split(": ", 1)[1].strip()
        address, token = url.split("/ui#token=")
        assert address.startswith("http://127.0.0.1:"), url
        assert httpx.get(f"{address}/ui", timeout=30).status_code == 200
        assert httpx.get(f"{address}/v1/status", timeout=30).status_code == 401  # the data needs the printed token
        status = httpx.get(f"{address}/v1/status", headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert status.status_code == 200, status.text
        published = status.json()
        assert published["job"] == JOB and published["state"] == "running" and published["epochs"] == 2, published
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.parametrize("extra, expected", [
    (["--job-name", "Digits_1"], "--job-name 'Digits_1' is not a DNS label"),
    (["--data", "./digits"], "--data './digits' is a path on this machine"),
    (["--data", "/mnt/digits", "--volume", "claim=td,mount_path=/data"], "--data '/mnt/digits' is a path on this machine"),
    (["--volume", "claim=td"], "--volume 'claim=td' needs mount_path"),
    (["--audit", "audit.jsonl"], "--audit 'audit.jsonl' is not on the master pod's scratch volume"),
    (["--job-dir", "/tmp/x"], "--job-dir: the job's folder is the master pod's own"),
    (["--mlflow-uri", "http://alice:hunter2@mlflow:5000"], "--mlflow-uri holds a password"),
    (["--worker-memory", "4Gi:2Gi"], "--worker-memory '4Gi:2Gi': the request 4Gi is larger than the limit 2Gi"),
    (["--workers", "4:2"], "--workers '4:2': the minimum 4 is larger than the maximum 2"),  # train's own check
    (["--ps-memory", "8Gi:4Gi"], "--ps-memory '8Gi:4Gi': the request 8Gi is larger than the limit 4Gi"),
    (["--global-batch-size", "64", "--lr-scaling", "linear"], "--lr-scaling linear has nothing to scale"),
    (["--image", "ghcr.io/elastic-step/elastic-step-torch:0.1.0", "--worker-gpu", "1"],
     "--worker-gpu 1 but the workers' image ghcr.io/elastic-step/elastic-step-torch:0.1.0 is a CPU-only build"),
    (["--device", "cuda"], "--device cuda but the worker pods request no GPU"),
])
def test_bad_flags_are_refused_in_one_line_without_a_cluster(tmp_path, capsys, extra, expected):
    """No kubeconfig at all: these are judged on the laptop, before any request."""
    from elastic_step.cli import main

    args = ["submit", "--job-name", JOB, "--image", "img", "--model-def", "m", "--data", "s3://b/digits", "--dry-run"]
    code = main(args + extra)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and expected in err, err
    assert "hunter2" not in err


@pytest.mark.parametrize("shards_flag", ["--ps-shards", "--ps"])
def test_a_ps_mode_job_is_submitted_with_its_shards_for_the_master_to_run_as_pods(capsys, shards_flag):
    """`--mode ps` reaches the master pod's `train` with its shard count: the master's
    Kubernetes backend runs the shards as pods of the job (tests/test_cluster_ps.py). Given as
    --ps, the count goes as --ps-shards, which every master's `train` reads."""
    from elastic_step.cli import main

    args = ["submit", "--job-name", JOB, "--image", "img", "--model-def", "elastic_step.model_zoo.deepfm_ps_torch",
            "--data", "s3://b/ctr", "--mode", "ps", shards_flag, "3", "--ps-memory", "8Gi", "--ps-table-limit-mb", "64",
            "--dry-run"]
    assert main(args) == 0
    (pod,) = yaml.safe_load_all(capsys.readouterr().out)
    argv = pod["spec"]["containers"][0]["args"]
    options = dict(zip(argv, argv[1:]))
    assert options["--mode"] == "ps" and options["--ps-shards"] == "3" and options["--backend"] == "kubernetes"
    assert options["--ps-memory"] == "8Gi"  # each shard pod's, for the tables it holds
    assert options["--ps-table-limit-mb"] == "64.0"  # past it, the tables are served from the shards' snapshots


def test_data_on_gcs_reaches_the_master_as_its_uri_and_is_read_by_workload_identity_not_a_store_secret(capsys):
    """A GKE user's `--data gs://...`: the master pod's `train` reads that URI, with the GCS
    options given and the workers' service account (the one bound to a Google account by
    workload identity); no store key is in its spec. The store Secret's keys are S3's, so naming
    one for gs:// data is refused in one line rather than handed to pods that cannot use it."""
    from elastic_step.cli import main

    args = ["submit", "--job-name", JOB, "--image", "img", "--model-def", "elastic_step.model_zoo.digits_torch",
            "--data", "gs://training-data/digits", "--storage-option", "project=ml-data", "--service-account", "gcs-reader"]
    assert main(args + ["--dry-run"]) == 0
    (pod,) = yaml.safe_load_all(capsys.readouterr().out)
    kubernetes_validate.validate(pod, "1.30.0", strict=True)
    main_container = pod["spec"]["containers"][0]
    options = dict(zip(main_container["args"], main_container["args"][1:]))
    assert options["--data"] == "gs://training-data/digits" and options["--storage-option"] == "project=ml-data"
    assert options["--service-account"] == "gcs-reader" and pod["spec"]["serviceAccountName"] == "elastic-step-runner"
    assert not [e["name"] for e in main_container["env"] if e["name"].startswith(("AWS_", "GOOGLE_")) or "secretKeyRef" in
                json.dumps(e)]
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["scratch"]

    code = main(args + ["--store-secret", STORE_SECRET, "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert f"--store-secret {STORE_SECRET}: its keys (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) are S3's" in err
    assert "workload identity" in err


def test_data_on_a_host_path_volume_as_elasticdl_mounts_it_reaches_the_master_and_every_worker(tmp_path, digits, cluster):
    """ElasticDL's minikube way: `--volume host_path=...,mount_path=/data --data /data`, the model a
    module of the image. The master mounts the node's folder, its workers get the same source at
    the same path (read-only), and the job trains from it with an exact audit."""
    folder = tmp_path / "node-data"
    shutil.copytree(digits, folder / "digits")
    for path in (tmp_path, folder, folder / "digits"):
        os.chmod(path, 0o755)  # the pods' user reads it, as a node's data folder would let it
    config = kubeconfig(cluster, tmp_path)
    done = elastic_step(config, "submit", "--job-name", JOB, "--image", cluster.project_image,
                        "--model-def", "elastic_step.model_zoo.digits_torch", "--volume", f"host_path={folder},mount_path=/data",
                        "--data", "/data/digits", "--workers", "2", "--epochs", "1", "--minibatch-size", "32",
                        "--checkpoint-steps", "0", "--audit", f"/tmp/{JOB}/audit.jsonl", "--no-progress")
    assert done.returncode == 0, done.stderr
    ns, pod_name = cluster.namespace, f"{JOB}-master"
    again = elastic_step(config, "submit", "--job-name", JOB, "--image", cluster.project_image, "--model-def", "m",
                         "--data", "s3://training-data/digits")
    assert again.returncode == 2 and f"job {JOB} already exists in namespace {ns}" in again.stderr, again.stderr
    deadline = time.monotonic() + 240
    while cluster.core().read_namespaced_pod(pod_name, ns).status.phase not in ("Succeeded", "Failed"):
        assert time.monotonic() < deadline, cluster.core().read_namespaced_pod_log(pod_name, ns)
        time.sleep(0.5)
    log = cluster.core().read_namespaced_pod_log(pod_name, ns)
    assert cluster.core().read_namespaced_pod(pod_name, ns).status.phase == "Succeeded", log
    report = audit_report(os.path.join(cluster.kubelet.volume_path(ns, pod_name, "scratch"), JOB, "audit.jsonl"), digits, 1)
    assert report["exact"] and report["rows_applied"] == report["rows_expected"], report
    workers = [e[4] for e in cluster.server.store.history if e[1] == "pods" and e[3] == "ADDED"
               and e[4]["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "worker"]
    assert len(workers) == 2
    for pod in workers:
        mounts = {m["mountPath"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes[mounts["/data"]["name"]]["hostPath"]["path"] == str(folder) and mounts["/data"]["readOnly"]
        assert "configMap" not in json.dumps(pod["spec"]["volumes"])  # no model file to ship: a module of the image
