"""Jobs on a cluster have names of their own, and a name several jobs answer to is refused.

Every Argo job's folder is `job` and every KFP task is named `train-elastic`, so the name a job
was given says nothing about which run it belongs to. On the cluster a job is named after its
pipeline run too (`elastic-step/job`, what `list` shows), and each attempt has its own instance.
`get`, `stop` and `logs` used to take the newest status ConfigMap among the jobs of a name: `stop`
could stop someone else's run. Now they refuse such a name and list the instances to choose
from. Against the fake API server (tests/kube_fake.py), with real masters' backends publishing."""

from __future__ import annotations

import time

import pytest

from elastic_step.backends.api import LaunchSpec
from elastic_step.backends.kubernetes.backend import KubernetesBackend
from elastic_step.backends.kubernetes.manifests import STOP_ANNOTATION, cluster_job_name
from elastic_step.backends.kubernetes.options import MasterPod, PodSettings
from elastic_step.operate.statusmap import WORKER_SELECTOR, AmbiguousJob, kubernetes_view, list_kubernetes, status_map, stop_kubernetes
from elastic_step.operate.pods import worker_pod

from kube_fake import FakeCoreV1Api


@pytest.fixture
def api(tmp_path):
    fake = FakeCoreV1Api(str(tmp_path / "cluster"))
    fake.unschedulable = "0/3 nodes are available"  # worker pods stay Pending: only their labels matter here
    yield fake
    fake.close()


def running_master(tmp_path, api, pod_name: str, job_name: str, given: str, step: int) -> KubernetesBackend:
    """A master in pod `pod_name` whose backend is named `job_name`, with one worker pod and its
    status published (`given`: the name the job was given, as its document says)."""
    pod = api.add_master_pod(pod_name, "es:1")
    token = tmp_path / f"{pod_name}.token"
    token.write_text("s3cret")
    spec = LaunchSpec("http://127.0.0.1:9", str(token), str(tmp_path), {})
    backend = KubernetesBackend(spec, PodSettings(namespace="ml", image="es:1"), job_name, api=api,
                                master=MasterPod(pod_name, pod.metadata.uid, "127.0.0.1", "ml"), watch_timeout_s=5)
    backend.launch(0, "w0.1")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(
            p.metadata.labels["app.kubernetes.io/instance"] == backend.names.instance
            for p in api.list_namespaced_pod("ml", label_selector=WORKER_SELECTOR).items):
        time.sleep(0.02)
    backend.publish({"info": {"job": given, "backend": "kubernetes", "started_at": time.time()},
                     "status": {"job": given, "state": "running", "step": step, "workers": []}})
    return backend


def test_a_jobs_name_on_the_cluster_carries_its_pipeline_run():
    assert cluster_job_name("job", "lifecycle-x7k2p") == "job-lifecycle-x7k2p"  # an Argo workflow
    assert cluster_job_name("train-elastic", "1b2c3d4e-5f60-4a1b-8c2d-3e4f5a6b7c8d") == "train-elastic-1b2c3d4e"  # a KFP run
    assert cluster_job_name("My_Job", "") == "my-job"  # no pipeline: the name it was given
    long = cluster_job_name("a" * 60, "elastic-step-lifecycle-abcde")
    assert long.endswith("-lifecycle-abcde") and len(long) <= 40  # the workflow's random tail survives the cut


def test_two_pipeline_runs_of_the_same_job_are_told_apart_and_the_shared_name_is_refused(tmp_path, api):
    a = running_master(tmp_path, api, "wf-a-train", cluster_job_name("job", "wf-a"), "job", step=3)
    b = running_master(tmp_path, api, "wf-b-train", cluster_job_name("job", "wf-b"), "job", step=8)
    try:
        assert sorted(r["job"] for r in list_kubernetes("ml", api=api)) == ["job-wf-a", "job-wf-b"]
        assert kubernetes_view("job-wf-a", "ml", api=api)["summary"]["step"] == 3
        assert kubernetes_view(b.names.instance, "ml", api=api)["summary"]["step"] == 8

        # The name both were given: refused, naming both instances, and nothing is asked to stop.
        with pytest.raises(AmbiguousJob) as refused:
            stop_kubernetes("job", "ml", 5, wait=False, api=api)
        assert a.names.instance in str(refused.value) and b.names.instance in str(refused.value)
        assert "wf-a-train" in str(refused.value) and "\n" not in str(refused.value)
        assert not any(STOP_ANNOTATION in (m.metadata.annotations or {}) for m in api.config_maps.values())
        with pytest.raises(AmbiguousJob):
            kubernetes_view("job", "ml", api=api)

        # Named by its instance, only that job is asked.
        assert "asked job" in stop_kubernetes(b.names.instance, "ml", 5, wait=False, api=api)
        assert STOP_ANNOTATION in (api.config_maps[b.names.status_map].metadata.annotations or {})
        assert STOP_ANNOTATION not in (api.config_maps[a.names.status_map].metadata.annotations or {})
    finally:
        a.shutdown(grace_s=0)
        b.shutdown(grace_s=0)


def test_two_jobs_with_the_same_label_are_refused_for_get_stop_and_logs(tmp_path, api):
    """Two jobs started outside any pipeline with the same --job-name share their label."""
    a = running_master(tmp_path, api, "laptop-a", "digits", "digits", step=1)
    b = running_master(tmp_path, api, "laptop-b", "digits", "digits", step=2)
    try:
        for read in (lambda: status_map(api, "ml", "digits"), lambda: stop_kubernetes("digits", "ml", 5, wait=False, api=api),
                     lambda: worker_pod(api, "ml", "digits", None, False)):
            with pytest.raises(AmbiguousJob, match=f"2 jobs in namespace ml answer to 'digits'.*{a.names.instance}"):
                read()
        pod, _ = worker_pod(api, "ml", a.names.instance, None, False)
        assert pod.startswith(a.names.instance)
    finally:
        a.shutdown(grace_s=0)
        b.shutdown(grace_s=0)


def test_a_retried_steps_ended_attempt_does_not_make_its_name_ambiguous(tmp_path, api):
    """A master killed outright leaves its status ConfigMap; its pod, kept by Argo and KFP, has
    ended. The running attempt of the same step is the job."""
    name = cluster_job_name("job", "wf-r")
    first = running_master(tmp_path, api, "wf-r-train-1", name, "job", step=5)
    second = running_master(tmp_path, api, "wf-r-train-2", name, "job", step=1)
    try:
        api.pods["wf-r-train-1"].pod.status.phase = "Failed"
        assert status_map(api, "ml", name).metadata.name == second.names.status_map
        assert kubernetes_view("job", "ml", api=api)["summary"]["step"] == 1
        pod, _ = worker_pod(api, "ml", name, None, False)  # logs: the running attempt's worker
        assert pod.startswith(second.names.instance)
    finally:
        first.shutdown(grace_s=0)
        second.shutdown(grace_s=0)
