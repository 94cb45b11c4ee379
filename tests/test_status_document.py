"""The status a master on Kubernetes publishes to its ConfigMap, and the operator's stop request
read from it, under an event flood and a failing update. The API server refuses a ConfigMap whose
data passes 1 MiB (etcd's object limit; `Too long: must have at most 1048576 bytes`): a document
that large made every update fail, and the stop annotation, read from the update's reply, was
never seen."""

from __future__ import annotations

import json
import threading
import time

import pytest

from elastic_step.backends.kubernetes.manifests import STATUS_KEY, STOP_ANNOTATION
from elastic_step.backends.kubernetes.options import MasterPod, PodSettings
from elastic_step.master.publisher import MAX_DOCUMENT_BYTES, StatusPublisher
from elastic_step.protocol import EventKind

from kube_fake import FakeCoreV1Api, api_error
from test_kubernetes_backend import unit_backend
from test_master_state import join_all, make_state

CONFIGMAP_LIMIT = 1024 * 1024


class LimitedApi(FakeCoreV1Api):
    """The fake API server, refusing ConfigMap data over 1 MiB as the real one does (422)."""

    def _refuse_too_long(self, data: dict | None) -> None:
        if sum(len(k) + len(v.encode()) for k, v in (data or {}).items()) > CONFIGMAP_LIMIT:
            raise api_error(422, "ConfigMap is invalid: []: Too long: must have at most 1048576 bytes")

    def create_namespaced_config_map(self, namespace, body, **kwargs):
        self._refuse_too_long(body.data)
        return super().create_namespaced_config_map(namespace, body, **kwargs)

    def patch_namespaced_config_map(self, name, namespace, body, **kwargs):
        self._refuse_too_long(body.get("data"))
        return super().patch_namespaced_config_map(name, namespace, body, **kwargs)


@pytest.fixture
def api(tmp_path):
    fake = LimitedApi(str(tmp_path / "cluster"))
    yield fake
    fake.close()


def running_job(tmp_path, api):
    state, _ = make_state()
    join_all(state)  # a ready round: a stop can be taken
    pod = api.add_master_pod("train-step-1", "es:1")  # its NetworkPolicy needs its labels
    backend = unit_backend(tmp_path, api, PodSettings(namespace="ml", image="es:1"),
                           master=MasterPod("train-step-1", pod.metadata.uid, "127.0.0.1", "ml"), request_timeout_s=2.0)
    return state, backend, StatusPublisher(state, backend, state.events, {"job": "unit", "backend": "kubernetes"})


def test_an_event_flood_is_published_within_the_limit_and_a_stop_is_still_seen(tmp_path, api):
    state, backend, publisher = running_job(tmp_path, api)
    publisher.publish_once()
    name = backend.names.status_map
    for i in range(300):  # every task failing with a 4 KB error
        state.events.record(EventKind.TASK_FAILED, f"task {i}: " + "x" * 4000, worker="w0.1")
    api.patch_namespaced_config_map(name, "ml", {"metadata": {"annotations": {STOP_ANNOTATION: "now"}}})  # `elastic-step stop`
    publisher.publish_once()
    text = api.config_maps[name].data[STATUS_KEY]
    assert len(text.encode()) <= MAX_DOCUMENT_BYTES < CONFIGMAP_LIMIT
    document = json.loads(text)
    assert document["events"][-1].get("message", "").startswith("task 299: ")  # the newest kept, the oldest left out
    assert document["events_next"] == len(state.events.events)
    assert publisher.stop_taken  # the request was seen (this job takes no checkpoints, so it is refused, saying why)
    backend.shutdown(grace_s=0)


def test_a_stop_is_read_even_when_the_status_update_fails(tmp_path, api):
    state, backend, publisher = running_job(tmp_path, api)
    assert backend.publish({"status": {"state": "running"}}) == {}
    name = backend.names.status_map
    api.patch_namespaced_config_map(name, "ml", {"metadata": {"annotations": {STOP_ANNOTATION: "now"}}})
    original = api.patch_namespaced_config_map

    def data_refused(name, namespace, body, **kwargs):  # e.g. an admission webhook refusing the new data
        if body.get("data"):
            raise api_error(500, "Internal error occurred")
        return original(name, namespace, body, **kwargs)

    api.patch_namespaced_config_map = data_refused
    assert backend.publish({"status": {"state": "running", "step": 9}}).keys() == {"stop"}
    backend.shutdown(grace_s=0)


def test_a_planted_newer_configmap_with_the_jobs_labels_is_not_taken_for_its_status(tmp_path, api):
    import datetime

    from kubernetes import client as k8s

    from elastic_step.operate.statusmap import WORKER_SELECTOR, kubernetes_view, status_map

    pod = api.add_master_pod("train-step-1", "es:1")
    backend = unit_backend(tmp_path, api, PodSettings(namespace="ml", image="es:1"),
                           master=MasterPod("train-step-1", pod.metadata.uid, "127.0.0.1", "ml"))
    backend.launch(0, "w0.1")  # a worker pod, owned by the master pod (made on the backend's own thread)
    deadline = time.monotonic() + 10
    while not api.list_namespaced_pod("ml", label_selector=WORKER_SELECTOR).items and time.monotonic() < deadline:
        time.sleep(0.02)
    genuine = {"info": {"job": "unit", "backend": "kubernetes"}, "status": {"job": "unit", "state": "running", "step": 7, "workers": []}}
    assert backend.publish(genuine) == {}
    labels = dict(api.config_maps[backend.names.status_map].metadata.labels)
    later = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)
    fake_doc = json.dumps({"info": {"job": "unit", "backend": "kubernetes"}, "status": {"job": "unit", "state": "failed", "step": 0}})
    owner = k8s.V1OwnerReference(api_version="v1", kind="Pod", name="train-step-1", uid=pod.metadata.uid)
    planted = [
        # the job's labels and its master as owner, another name
        (f"{backend.names.instance}-status-2", labels, [owner]),
        # an instance of its own, owned by the real master pod (whose UID anyone may read), with no workers
        ("unit-evil-status", {**labels, "app.kubernetes.io/instance": "unit-evil"}, [owner]),
        # the master's name, a UID that is not its pod's
        ("unit-abc-status", {**labels, "app.kubernetes.io/instance": "unit-abc"},
         [k8s.V1OwnerReference(api_version="v1", kind="Pod", name="train-step-1", uid="not-the-pods-uid")]),
    ]
    for name, its_labels, owners in planted:
        api.create_namespaced_config_map("ml", k8s.V1ConfigMap(metadata=k8s.V1ObjectMeta(
            name=name, labels=its_labels, owner_references=owners, creation_timestamp=later), data={STATUS_KEY: fake_doc}))
    assert status_map(api, "ml", "unit").metadata.name == backend.names.status_map
    assert kubernetes_view("unit", "ml", api=api)["summary"]["step"] == 7
    backend.shutdown(grace_s=0)


def test_a_configmap_planted_under_the_jobs_status_name_before_its_master_made_it_is_replaced(tmp_path, api):
    """The instance is in the job's Secret's name as soon as the master makes it, before the first
    publish: a ConfigMap planted under its status name, carrying a stop request, was adopted (the
    create's 409 read as a lost reply) and the stop taken."""
    from kubernetes import client as k8s

    state, backend, publisher = running_job(tmp_path, api)
    name = backend.names.status_map
    stranger = k8s.V1OwnerReference(api_version="v1", kind="Pod", name="someone-elses", uid="uid-x")
    api.create_namespaced_config_map("ml", k8s.V1ConfigMap(metadata=k8s.V1ObjectMeta(
        name=name, labels={"app.kubernetes.io/instance": backend.names.instance}, owner_references=[stranger],
        annotations={STOP_ANNOTATION: "planted"}), data={STATUS_KEY: "{}"}))
    publisher.publish_once()
    publisher.publish_once()
    assert not publisher.stop_taken
    made = api.config_maps[name]
    assert [o.uid for o in made.metadata.owner_references] == [backend.master.uid] and STOP_ANNOTATION not in (made.metadata.annotations or {})
    assert json.loads(made.data[STATUS_KEY])["info"]["job"] == "unit"
    backend.shutdown(grace_s=0)


def test_scale_on_kubernetes_reaches_the_master_through_its_status_configmap(tmp_path, api):
    """`elastic-step scale JOB --workers N --backend kubernetes`: the request is an annotation the
    master's next publish takes in, once per value; a number outside the job's range is refused
    by the operator's command, before anything is asked."""
    from elastic_step.errors import ElasticStepError
    from elastic_step.operate.kubernetes import KubernetesJobs

    state, backend, publisher = running_job(tmp_path, api)  # workers 2:3, 3 running
    publisher.publish_once()
    jobs = KubernetesJobs("ml", api=api)
    with pytest.raises(ElasticStepError, match="outside its range 2:3"):
        jobs.scale(backend.names.instance, 5)
    assert "asked job" in jobs.scale(backend.names.instance, 2)
    publisher.publish_once()
    assert state.membership.target == 2 and [e["target"] for e in state.events.of(EventKind.SCALED)] == [2]
    publisher.publish_once()  # the annotation stays: the same request is not taken twice
    assert len(state.events.of(EventKind.SCALED)) == 1
    assert json.loads(api.config_maps[backend.names.status_map].data[STATUS_KEY])["status"]["target_workers"] == 2
    backend.shutdown(grace_s=0)


class ShardsOfTheJob:
    """The master's ShardMonitor as `scale --ps` reaches it: its rows in the status, and a scale
    that answers as the real one does (what moved, ps/moves.py; ValueError when it cannot)."""

    def __init__(self, count: int):
        self.count = count
        self.asked: list[int] = []

    def rows(self) -> list[dict]:
        return [{"shard": i, "address": f"10.0.0.{i}:7460", "state": "serving"} for i in range(self.count)]

    def scale(self, shards: int) -> dict:
        self.asked.append(shards)
        if shards == self.count:
            raise ValueError(f"the job already runs {shards} parameter-server shards")
        self.count = shards
        return {"epoch": len(self.asked), "virtual_shards": 128, "moved": 42, "rows_total": 9000, "rows_moved": 2950,
                "seconds": 1.25, "pause_max_s": 0.031, "pause_mean_s": 0.01}


def test_scale_ps_on_kubernetes_reaches_the_master_through_its_status_configmap(tmp_path, api, monkeypatch, capsys):
    """`elastic-step scale JOB --ps N --backend kubernetes`: the request (an annotation naming it)
    is taken in by the master's next publish, the rows move on a thread of their own, and the
    command prints what moved from the answer the master publishes; a refusal is one line, exit 2,
    and asking the same count again is a new request, answered again."""
    from elastic_step.cli import main as cli_main

    monkeypatch.setattr("elastic_step.operate.kubernetes.core_api", lambda: api)
    monkeypatch.setattr("elastic_step.operate.ps_scale.POLL_S", 0.05)
    monkeypatch.setattr("elastic_step.operate.ps_scale.ANSWER_TIMEOUT_S", 20.0)  # a request the master never answers fails the test
    state, backend, publisher = running_job(tmp_path, api)
    state.ps_shards = shards = ShardsOfTheJob(2)
    publisher.interval_s = 0.05
    publisher.start()
    try:
        scale = ["scale", backend.names.instance, "--ps", "3", "--backend", "kubernetes", "-n", "ml"]
        assert cli_main(scale) == 0
        assert capsys.readouterr().out.strip() == (
            f"job {state.status()['job']} runs 3 parameter-server shards (routing epoch 1): moved 42 of 128 virtual shards, 2950 of 9000 rows, "
            "in 1.25 s; each moved virtual shard paused at most 0.03 s")
        assert cli_main(scale) == 2
        said = capsys.readouterr().err.strip()
        assert len(said.splitlines()) == 1 and "cannot run 3 parameter-server shards: the job already runs 3" in said, said
        assert shards.asked == [3, 3]
        time.sleep(0.3)  # more publishes: each request is taken once
        assert shards.asked == [3, 3]
    finally:
        publisher.close()
        backend.shutdown(grace_s=0)


class SlowShards(ShardsOfTheJob):
    """A move that takes a while; a second scale meanwhile is refused, as ShardMonitor refuses it."""

    def __init__(self, count: int):
        super().__init__(count)
        self.moving, self.began = threading.Lock(), threading.Event()

    def scale(self, shards: int) -> dict:
        if not self.moving.acquire(blocking=False):
            raise ValueError("another scale --ps of this job is under way")
        try:
            self.began.set()
            time.sleep(0.6)
            return super().scale(shards)
        finally:
            self.moving.release()


def test_a_scale_ps_refused_while_another_moves_leaves_the_first_operator_its_answer(tmp_path, api, monkeypatch):
    from elastic_step.errors import ElasticStepError
    from elastic_step.operate.ps_scale import scale_ps_kubernetes

    monkeypatch.setattr("elastic_step.operate.ps_scale.POLL_S", 0.05)
    monkeypatch.setattr("elastic_step.operate.ps_scale.ANSWER_TIMEOUT_S", 8.0)
    state, backend, publisher = running_job(tmp_path, api)
    state.ps_shards = shards = SlowShards(2)
    publisher.interval_s = 0.05
    publisher.start()
    first: dict = {}
    try:
        asking = threading.Thread(target=lambda: first.update(scale_ps_kubernetes(backend.names.instance, "ml", 3, api)))
        asking.start()
        assert shards.began.wait(5)  # the first request taken, its rows moving
        with pytest.raises(ElasticStepError, match="another scale --ps of this job is under way"):
            scale_ps_kubernetes(backend.names.instance, "ml", 4, api)
        asking.join(10)
        assert first["ps_scale"]["rows_moved"] == 2950 and shards.count == 3, first
    finally:
        publisher.close()
        backend.shutdown(grace_s=0)


def test_scale_ps_of_a_job_without_shards_on_kubernetes_is_refused_before_anything_is_asked(tmp_path, api, monkeypatch, capsys):
    from elastic_step.backends.kubernetes.manifests import PS_SCALE_ANNOTATION
    from elastic_step.cli import main as cli_main

    monkeypatch.setattr("elastic_step.operate.kubernetes.core_api", lambda: api)
    state, backend, publisher = running_job(tmp_path, api)  # a dense job: no parameter-server shards
    publisher.publish_once()
    assert cli_main(["scale", backend.names.instance, "--ps", "3", "--backend", "kubernetes", "-n", "ml"]) == 2
    said = capsys.readouterr().err.strip()
    assert len(said.splitlines()) == 1 and "has no parameter-server shards" in said, said
    assert PS_SCALE_ANNOTATION not in (api.config_maps[backend.names.status_map].metadata.annotations or {})
    backend.shutdown(grace_s=0)
