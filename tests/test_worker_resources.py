"""Workers report what they use in their heartbeats (psutil; NVML where GPUs exist), and the
master keeps each worker's newest sample for `get` and `top`."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from elastic_step.master.api import create_app
from elastic_step.protocol import GpuSample, ResourceSample, WorkerState
from elastic_step.worker.resources import Nvml, ResourceSampler, visible_gpu_indices

from test_master_state import make_state

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_the_sampler_measures_this_process():
    sampler = ResourceSampler()
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:  # burn CPU so the next sample has something to show
        pass
    sample = sampler.sample()
    assert sample is not None
    assert sample.rss_bytes > 10 * 2**20  # a Python process with pydantic and psutil loaded
    assert sample.cpu_percent > 10.0
    assert abs(sample.time - time.time()) < 5


def test_gpus_are_sampled_where_nvml_finds_them():
    nvml = Nvml()
    if not nvml.handles:
        pytest.skip("no GPU")
    gpus = nvml.sample()
    assert gpus and all(g.memory_total_bytes > 0 and 0 <= g.utilization_percent <= 100 for g in gpus)
    assert all(g.memory_used_bytes <= g.memory_total_bytes for g in gpus)


def test_cuda_visible_devices_chooses_the_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert visible_gpu_indices(4) == [2, 0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpu_indices(4) == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1234")
    assert visible_gpu_indices(2) == [0, 1]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_gpu_indices(3) == [0, 1, 2]


def sample(at: float, rss: int) -> dict:
    return ResourceSample(time=at, cpu_percent=50.0, rss_bytes=rss,
                          gpus=[GpuSample(index=0, name="g", utilization_percent=30, memory_used_bytes=1, memory_total_bytes=2)]).model_dump()


def by_id(status: dict) -> dict:
    return {w["id"]: w for w in status["workers"]}


def test_the_master_keeps_each_workers_newest_sample():
    state, _ = make_state()
    api = TestClient(create_app(state, TOKEN))
    for body in ({"worker_id": "w0.1", "resources": sample(100.0, 1000)},
                 {"worker_id": "w0.1", "resources": sample(99.0, 5)},  # late and older: ignored
                 {"worker_id": "w0.1"}):  # an older worker sends none: the figures stay
        assert api.post("/v1/heartbeat", headers=AUTH, json=body).status_code == 200
    worker = by_id(api.get("/v1/status", headers=AUTH).json())["w0.1"]
    assert worker["resources"]["rss_bytes"] == 1000 and worker["resources"]["gpus"][0]["utilization_percent"] == 30
    assert by_id(state.status())["w1.1"]["resources"] is None
    assert api.post("/v1/heartbeat", headers=AUTH, json={"worker_id": "w0.1", "resources": sample(101.0, 2000)}).status_code == 200
    assert by_id(state.status())["w0.1"]["resources"]["rss_bytes"] == 2000


@pytest.mark.parametrize("resources", [
    {"time": 1.0, "cpu_percent": -1.0, "rss_bytes": 1},
    {"time": 1.0, "cpu_percent": 1.0, "rss_bytes": "many"},
    {"time": 1.0, "cpu_percent": 1.0, "rss_bytes": 1, "gpus": [{"index": 0, "utilization_percent": 101.0,
                                                              "memory_used_bytes": 1, "memory_total_bytes": 1}]},
    {"time": 1.0, "cpu_percent": 1.0, "rss_bytes": 1, "swap": 3},
])
def test_malformed_figures_are_refused_and_change_nothing(resources):
    state, _ = make_state()
    api = TestClient(create_app(state, TOKEN))
    before = state.status()
    response = api.post("/v1/heartbeat", headers=AUTH, json={"worker_id": "w0.1", "resources": resources})
    assert response.status_code == 422, response.text
    assert state.status() == before


def test_a_gone_worker_s_figures_are_not_updated():
    state, _ = make_state()
    state.heartbeat("w0.1", 0, ResourceSample.model_validate(sample(1.0, 10)))
    state.workers["w0.1"].state = WorkerState.GONE
    state.heartbeat("w0.1", 0, ResourceSample.model_validate(sample(2.0, 20)))
    assert state.workers["w0.1"].resources.rss_bytes == 10


class BeatsSent:
    """A master client that keeps each heartbeat it is sent and answers "continue"."""

    def __init__(self):
        self.sent = []

    def call(self, method, path, body):
        self.sent.append(body)
        return {"round_id": 0, "acked_step": 0, "action": "continue"}


def test_heartbeats_carry_the_figures():
    from elastic_step.worker.background import Heartbeat

    client = BeatsSent()
    sent = client.sent
    beat = Heartbeat(client, "w0.1", 0.01)
    beat.start()
    deadline = time.monotonic() + 5
    while len(sent) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    beat.halt()
    assert sent[-1].resources is not None and sent[-1].resources.rss_bytes > 0


def test_a_beat_asked_for_now_goes_at_once_with_the_round_and_step_together():
    from elastic_step.worker.background import Heartbeat

    client = BeatsSent()
    sent = client.sent
    beat = Heartbeat(client, "w0.1", 60.0)  # the next regular beat is a minute away
    beat.start()
    deadline = time.monotonic() + 5
    while not sent and time.monotonic() < deadline:
        time.sleep(0.01)
    beat.position = (3, 41)
    beat.beat_now()
    deadline = time.monotonic() + 5
    while len(sent) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    beat.halt()
    assert [(b.round_id, b.step) for b in sent] == [(0, -1), (3, 41)]
    beat.join(5)
    assert not beat.is_alive()  # halt wakes it from its wait
