"""The backend against the fake CoreV1Api (tests/kube_fake.py), without a master: what the
cluster does to pods (evict, preempt, a deletion during a watch gap) becomes WorkerExits with
the right relaunch policy, and shutdown leaves nothing behind."""

from __future__ import annotations

import time

from elastic_step.backends.api import LaunchSpec
from elastic_step.backends.kubernetes.backend import KubernetesBackend
from elastic_step.backends.kubernetes.options import MasterPod, PodSettings

from kube_fake import FakeCoreV1Api


def exits_until(backend, count, timeout=30.0):
    exits, deadline = [], time.monotonic() + timeout
    while len(exits) < count and time.monotonic() < deadline:
        exits += backend.poll()
        time.sleep(0.05)
    return {e.worker_id: e for e in exits}


def test_evicted_preempted_and_vanished_pods_are_free_relaunches_and_shutdown_cleans_up(tmp_path):
    fake = FakeCoreV1Api(str(tmp_path / "cluster"))
    token = tmp_path / "token"
    token.write_text("s3cret")
    try:
        # The master URL leads nowhere: these workers only need to be running processes.
        spec = LaunchSpec("http://127.0.0.1:9", str(token), str(tmp_path), {"ELASTIC_STEP_TEST": "1"})
        backend = KubernetesBackend(spec, PodSettings(namespace="ml", image="img:1"), "unit", api=fake,
                                    master=MasterPod("m", "uid-m", "127.0.0.1"), watch_timeout_s=5)
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
