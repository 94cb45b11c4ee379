"""elastic_step.operate: one interface for reading and steering a job, whatever runs it. The CLI
asks it and never branches on the backend; which backend a command means comes from --backend,
else the environment, else where the job named is (a job folder here, or a cluster)."""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import time

import pytest

from elastic_step.backends.kubernetes.options import MasterPod, PodSettings
from elastic_step.cli.observe import backend_of
from elastic_step.errors import ElasticStepError
from elastic_step.operate import LogRequest
from elastic_step.operate.kubernetes import KubernetesJobs

from kube_fake import FakeCoreV1Api
from test_kubernetes_backend import unit_backend

CLI = pathlib.Path(__file__).resolve().parent.parent / "elastic_step" / "cli"


def test_the_operating_commands_never_branch_on_the_backend():
    for name in ("observe.py", "jobs.py", "logs.py"):
        tree = ast.parse((CLI / name).read_text())
        compared = [node for node in ast.walk(tree) if isinstance(node, ast.Compare)
                    and any(isinstance(c, ast.Constant) and c.value in ("local", "kubernetes") for c in [node.left, *node.comparators])]
        assert not compared, f"{name} compares with a backend's name at line {compared[0].lineno}"


@pytest.mark.parametrize("command", ["list", "get", "status", "top", "logs", "stop", "scale", "ui", "delete"])
def test_every_command_that_names_a_job_takes_its_namespace_the_same_way(command, monkeypatch):
    from elastic_step.cli import build_parser

    extra = ["--workers", "2"] if command == "scale" else []
    job = [] if command == "list" else ["digits"]
    monkeypatch.delenv("ELASTIC_STEP_NAMESPACE", raising=False)
    assert build_parser().parse_args([command, *job, "-n", "team-a", *extra]).namespace == "team-a"
    assert build_parser().parse_args([command, *job, "--namespace", "team-b", *extra]).namespace == "team-b"
    monkeypatch.setenv("ELASTIC_STEP_NAMESPACE", "from-env")
    assert build_parser().parse_args([command, *job, *extra]).namespace == "from-env"


def test_which_backend_a_command_means(tmp_path, monkeypatch):
    job = tmp_path / "digits"
    job.mkdir()
    (job / "result.json").write_text("{}")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config
    monkeypatch.delenv("KUBECONFIG", raising=False)

    def args(job_name, backend=None):
        return argparse.Namespace(job=job_name, job_dir=None, root=str(tmp_path), backend=backend)

    assert backend_of(args("digits")) == "local"  # a job folder under --root
    assert backend_of(args("job-wf-a")) == "local"  # nowhere to look but here: the local error says where it looked
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "config"))
    assert backend_of(args("digits")) == "local"
    assert backend_of(args("job-wf-a")) == "kubernetes"
    assert backend_of(args("digits", backend="kubernetes")) == "kubernetes"


def test_a_job_on_kubernetes_is_read_and_steered_through_the_interface(tmp_path):
    api = FakeCoreV1Api(str(tmp_path / "cluster"))
    try:
        pod = api.add_master_pod("train-step-1", "es:1")
        backend = unit_backend(tmp_path, api, PodSettings(namespace="ml", image="es:1"),
                               master=MasterPod("train-step-1", pod.metadata.uid, "127.0.0.1", "ml"))
        backend.launch(0, "w0.1")
        deadline = time.monotonic() + 10
        while not api.list_namespaced_pod("ml", label_selector="app.kubernetes.io/component=worker").items:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        status = {"job": "unit", "state": "running", "step": 4, "workers_range": [1, 2],
                  "workers": [{"id": "w0.1", "slot": 0, "state": "live"}]}
        backend.publish({"info": {"job": "unit", "backend": "kubernetes"}, "status": status,
                         "events": [{"time": 1.0, "event": "checkpoint", "step": 4}]})
        jobs = KubernetesJobs("ml", api=api)

        [row] = jobs.jobs()
        assert row["job"] == "unit" and row["where"] == f"ml/{backend.names.instance}"
        assert jobs.locate("unit") == backend.names.instance
        view = jobs.view("unit", with_events=True)
        assert view["summary"]["step"] == 4 and [e["event"] for e in view["events"]] == ["checkpoint"]
        page = jobs.live_page("unit")
        assert page.url is None and json.loads(json.dumps(page.read()))["status"]["step"] == 4
        with pytest.raises(ElasticStepError, match="outside its range 1:2"):
            jobs.scale("unit", 3)
        assert "asked job unit to stop" in jobs.stop("unit", 5, wait=False, say=print)
        with pytest.raises(ElasticStepError, match="no worker pods of job 'nope'"):
            list(jobs.log_lines("nope", LogRequest(worker="w0")))
        backend.shutdown(grace_s=0)
    finally:
        api.close()
