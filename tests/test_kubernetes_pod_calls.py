"""The Kubernetes backend's pod calls (backends/kubernetes/calls.py): a worker's pod the master
asked to delete is deleted, even when the API server fails the first tries (a timeout, a 500, a
429 under load). A pod left behind would hold its worker's slot and the job would wait for an exit
that never comes."""

from __future__ import annotations

import logging
import threading

from kubernetes import client as k8s

from elastic_step.backends.kubernetes import calls
from waiting import wait_for


class FlakyApi:
    """delete_namespaced_pod fails `failures` times (a 500, then a dropped connection), then works."""

    def __init__(self, failures: int):
        self.failures, self.tries, self.deleted = failures, 0, threading.Event()

    def delete_namespaced_pod(self, name, namespace, grace_period_seconds, _request_timeout):
        assert grace_period_seconds == 0 and _request_timeout
        self.tries += 1
        if self.tries <= self.failures:
            if self.tries % 2:
                raise k8s.ApiException(status=500, reason="Internal Server Error")
            raise ConnectionResetError("connection reset by peer")
        self.deleted.set()


def test_a_pod_whose_delete_fails_is_deleted_again_until_it_is_gone():
    api = FlakyApi(failures=3)
    pods = calls.PodCalls(api, "ml", 5.0, on_create_failed=lambda *_: None)
    pods.delete("job-w0")
    assert api.deleted.wait(15), f"deleted only after {api.tries} tries"
    assert api.tries == 4
    pods.close(5)


def test_a_pod_already_gone_is_not_deleted_again(monkeypatch):
    class GoneApi(FlakyApi):
        def delete_namespaced_pod(self, *args, **kwargs):
            self.tries += 1
            raise k8s.ApiException(status=404, reason="Not Found")

    api = GoneApi(failures=0)
    pods = calls.PodCalls(api, "ml", 5.0, on_create_failed=lambda *_: None)
    pods.delete("job-w0")
    assert pods.wait_idle(5)
    assert api.tries == 1
    pods.close(5)


def test_after_the_last_try_the_log_says_how_to_delete_it_by_hand(monkeypatch, caplog):
    monkeypatch.setattr(calls, "DELETE_RETRY_S", (0.05, 0.05))
    api = FlakyApi(failures=100)
    pods = calls.PodCalls(api, "ml", 5.0, on_create_failed=lambda *_: None)
    with caplog.at_level(logging.ERROR, logger="elastic_step.backends.kubernetes"):
        pods.delete("job-w0")
        wait_for(lambda: any("kubectl delete pod job-w0 -n ml" in r.getMessage() for r in caplog.records), 10,
                 "the by-hand line")
    assert api.tries == 3  # the first try and one for each pause
    pods.close(5)
