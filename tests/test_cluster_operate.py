"""Operating a job on Kubernetes as a person does: `elastic-step list|get|top|logs|stop --backend
kubernetes` run as separate processes with a kubeconfig of their own user, who holds only the
Role in deploy/operator, against the cluster stand-in (tests/cluster) where the master is a pod
and its workers are pods it made. Nothing reaches the master's port or its folder: what the
commands show comes through the API server (the status ConfigMap the master keeps, pods, pod
logs), and once the job has ended, from its MLflow run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from cluster import Cluster, role_rules
from cluster.rbac import REPO, kustomize_namespace, read_manifests
from stores import upload
from test_cluster_e2e import BUCKET, SCRATCH, MasterOnNode, cluster, master_pod, s3, store_secret  # noqa: F401  (fixtures)
from test_live_page import browser  # noqa: F401  (a fixture: Debian's chromium, headless)

pytestmark = pytest.mark.e2e

JOB = "digits-op"
JOB_DIR = f"{SCRATCH}/{JOB}"  # the job's name is its folder's
OPERATOR_RBAC = os.path.join(REPO, "deploy", "operator")


def kubeconfig(cluster: Cluster, folder, user: str, roles: bool) -> str:
    """A kubeconfig of `user` (bound to deploy/operator's Role in the job's namespace when `roles`)."""
    if roles:
        for obj in kustomize_namespace(read_manifests(OPERATOR_RBAC), cluster.namespace):
            cluster.authorizer.apply(obj)
        cluster.authorizer.add_binding(cluster.namespace, {"kind": "Role", "name": "elastic-step-operator"},
                                       [{"kind": "User", "name": user}])
    return cluster.kubeconfig(folder, user, cluster.authorizer.issue_token(user))


def as_user(config: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "MLFLOW_"))}
    return subprocess.run([sys.executable, "-m", "elastic_step.cli", *args], capture_output=True, text=True,
                          env={**env, "KUBECONFIG": config}, timeout=timeout)


def get(config: str, *extra: str) -> dict | None:
    done = as_user(config, "get", JOB, "--backend", "kubernetes", "-o", "json", *extra)
    return json.loads(done.stdout) if done.returncode == 0 else None


def wait_for(config: str, predicate, what: str, master: MasterOnNode, timeout: float = 150) -> dict:
    deadline, view = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        view = get(config, "-e")
        if view is not None and predicate(view):
            return view
        if master.phase() in ("Succeeded", "Failed"):
            break
        time.sleep(1.0)
    raise AssertionError(f"{what}: not seen within {timeout}s; last view {view}\n{master.log()[-4000:]}")


def test_an_operator_lists_gets_tops_reads_logs_and_stops_a_job_on_worker_pods_through_the_api_alone(tmp_path, digits, s3, cluster,
                                                                                                       browser):
    data = upload(s3, digits, BUCKET, "digits")
    ns = cluster.namespace
    api = cluster.core()
    store_secret(api, ns)
    args = ["--backend", "kubernetes", "--data", data, "--storage-option", f"endpoint_url={s3}", "--model-def", "slow_digits",
            "--job-dir", JOB_DIR, "--workers", "2", "--epochs", "40", "--minibatch-size", "16", "--minibatches-per-task", "2",
            "--heartbeat-timeout", "4", "--checkpoint-steps", "50", "--worker-cpu", "1", "--worker-memory", "1Gi", "--no-progress"]
    api.create_namespaced_pod(ns, master_pod(cluster, "train-step-op", args))
    master = MasterOnNode(cluster, "train-step-op", JOB_DIR)
    alice = kubeconfig(cluster, tmp_path, "alice", roles=True)

    # get: the job as its master published it, with its workers' pods and what they use.
    view = wait_for(alice, lambda v: v["summary"]["state"] == "running" and v["summary"]["world_size"] == 2
                    and (v["summary"]["step"] or 0) > 0 and all(w["rss_bytes"] for w in v["workers"]), "two workers training", master)
    summary = view["summary"]
    assert summary["job"] == JOB and summary["job_dir"] == f"pod {ns}/train-step-op", summary
    assert summary["mlflow"]["run_id"] and "mlflow artifacts download -r" in summary["tensorboard"]
    pods = {w["id"]: w["pod"] for w in view["workers"]}
    assert all(p and p.startswith(f"{JOB}-") for p in pods.values()), view["workers"]

    # A worker's container is SIGKILLed: get -e shows the death, the relaunch, and the slot's history.
    victim = next(w for w in view["workers"] if w["rank"] == 1)
    cluster.kubelet.kill(ns, victim["pod"])
    view = wait_for(alice, lambda v: any(w["slot"] == victim["slot"] and w["relaunches"] == 1 and w["state"] == "live"
                                         for w in v["workers"]), "the killed worker relaunched", master)
    died = [e for e in view["events"] if e["event"] == "died"]
    assert [e["worker"] for e in died] == [victim["id"]] and ("137" in died[0]["reason"] or "SIGKILL" in died[0]["reason"])
    assert any(e["event"] == "relaunched" for e in view["events"])
    row = next(w for w in view["workers"] if w["slot"] == victim["slot"])
    assert row["relaunch_causes"] == [died[0]["reason"]]

    # list: the job with its published progress; top: the worker table; logs: a worker's pod log.
    listed = as_user(alice, "list", "--backend", "kubernetes", "-o", "json")
    assert listed.returncode == 0, listed.stderr
    job = next(r for r in json.loads(listed.stdout) if r["job"] == JOB)
    assert job["state"] == "running" and job["epochs"] == 40 and job["rows_total"] > 0 and job["workers_live"] == 2, job
    top = as_user(alice, "top", JOB, "--backend", "kubernetes", "-r", "0.5", "--iterations", "2")
    assert top.returncode == 0 and row["id"] in top.stdout and "train-step-op" in top.stdout, top.stdout + top.stderr
    top = as_user(alice, "top", "--backend", "kubernetes", "--iterations", "1")  # one line per job
    line = next(text for text in top.stdout.splitlines() if text.startswith(JOB))
    assert "running" in line and "2/2" in line and "/40" in line and ns in line, top.stdout
    logs = as_user(alice, "logs", JOB, "--backend", "kubernetes", "--worker", "w0", "--tail", "5")
    assert logs.returncode == 0 and 0 < len(logs.stdout.strip().splitlines()) <= 5, logs.stdout + logs.stderr
    logs = as_user(alice, "logs", JOB, "--backend", "kubernetes", "--master")  # the step pod's main container
    assert logs.returncode == 0 and logs.stdout.strip() and logs.stdout.strip() in master.log(), logs.stdout + logs.stderr
    # without -v or a progress line, the step's log still says why the group changed
    assert any("died" in line and victim["id"] in line for line in logs.stdout.splitlines()), logs.stdout

    # ui: the live page, served on this machine's loopback from the published status, in a browser.
    live_page(alice, browser, tmp_path, victim["id"])

    # stop: a request on the job's status; the master checkpoints, stops its workers and exits 0.
    stopped = as_user(alice, "stop", JOB, "--backend", "kubernetes", "--timeout", "120", timeout=180)
    assert stopped.returncode == 0 and "stopped at a checkpoint" in stopped.stdout, stopped.stdout + stopped.stderr
    assert master.phase() == "Succeeded", master.log()[-3000:]
    with open(master.path(f"{JOB_DIR}/result.json")) as f:
        result = json.load(f)
    assert result["state"] == "stopped" and result["checkpoint_step"], result
    with open(master.path(f"{JOB_DIR}/logs/master.log")) as f:
        assert "stop requested by the operator (the job's status ConfigMap)" in f.read()

    # Once ended, nothing of the job is left in the cluster; get reads its MLflow run.
    assert not [m for m in cluster.objects("configmaps") if m["metadata"]["name"].startswith(JOB)]
    gone = as_user(alice, "get", JOB, "--backend", "kubernetes")
    assert gone.returncode == 2 and "--mlflow-uri" in gone.stderr and len(gone.stderr.strip().splitlines()) == 1, gone.stderr
    ended = get(alice, "--mlflow-uri", f"sqlite:///{master.path(SCRATCH + '/mlflow.db')}")
    assert ended is not None and ended["summary"]["state"] == "stopped", ended
    assert ended["summary"]["mlflow"]["run_id"] == result["run_id"] == summary["mlflow"]["run_id"]

    # What alice asked of the API is exactly the operator Role; the master's calls exactly its own.
    alice_used = {(verb, resource) for verb, resource, _ in cluster.used("alice")}
    assert cluster.refused("alice") == set() and alice_used == role_rules(OPERATOR_RBAC), alice_used
    assert {(verb, resource) for verb, resource, _ in cluster.used()} == role_rules()


def until(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not seen within {timeout}s"
        time.sleep(0.5)


def live_page(config: str, browser, tmp_path, killed: str) -> None:
    import httpx

    server = subprocess.Popen([sys.executable, "-m", "elastic_step.cli", "ui", JOB], stdout=subprocess.PIPE, text=True,
                              env={**{k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}, "KUBECONFIG": config})
    try:
        line = server.stdout.readline()
        assert f"live page of job {JOB} (pod " in line, line
        url = line.split(": ", 1)[1].strip()
        assert url.startswith("http://127.0.0.1:") and "/ui#token=" in url, url
        address = url.split("/ui#")[0]
        assert httpx.get(f"{address}/v1/status").status_code == 401  # the page's data needs the address's token
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        page.goto(url)
        from playwright.sync_api import expect  # locator assertions evaluate no strings: the page's CSP allows no eval

        expect(page.locator("#state")).to_have_text("running", timeout=30_000)
        assert page.locator("#job").inner_text() == JOB and page.locator("#world").inner_text() == "2 / 2"
        page.wait_for_selector("#loss-chart path.series", state="attached", timeout=30_000)
        attempts = page.locator("#timeline g.attempt")
        assert killed in [attempts.nth(i).get_attribute("data-worker") for i in range(attempts.count())]
        # Polled from here: the page's CSP forbids the eval a polling wait_for_function needs.
        until(lambda: "relaunched" in page.locator("#events tbody").inner_text(), "the relaunch in the page's events")
        step = int(page.locator("#step").inner_text())
        until(lambda: int(page.locator("#step").inner_text()) > step, "the page following the job")
        page.screenshot(path=str(tmp_path / "live-page-kubernetes.png"), full_page=True)
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_commands_without_the_operator_role_or_for_an_unknown_job_fail_in_one_line(tmp_path, cluster):
    bob = kubeconfig(cluster, tmp_path, "bob", roles=False)
    for command in (["get", JOB], ["stop", JOB], ["top", JOB, "--iterations", "1"]):
        done = as_user(bob, *command, "--backend", "kubernetes")
        error = done.stderr.strip()
        # top too: a missing right does not heal by refreshing, so it fails at once as get does
        assert done.returncode == 2 and "deploy/operator" in error and len(error.splitlines()) == 1, error
    alice = kubeconfig(cluster, tmp_path, "alice", roles=True)
    done = as_user(alice, "get", "nope", "--backend", "kubernetes")
    assert done.returncode == 2 and "no running job 'nope'" in done.stderr and len(done.stderr.strip().splitlines()) == 1
