"""The backend's own thread for the API calls the master's decisions cause (create and delete
pods): the master, which holds its lock around `launch` and `stop`, only enqueues. Every call
carries a request timeout, so a stalled API server delays pods and never hangs this thread."""

from __future__ import annotations

import json
import logging
import queue
import threading

from kubernetes import client as k8s

log = logging.getLogger("elastic_step.backends.kubernetes")

REQUEST_TIMEOUT_S = 30.0  # every API call, in seconds
# A worker's pod whose delete fails (a timeout, a 500, a 429) is deleted again after each of these
# pauses: a dropped worker whose pod stays would hold its slot, and the job would wait for its exit.
DELETE_RETRY_S = (0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0)


class PodCalls:
    """The backend's own thread for the API calls the master's decisions cause (create and
    delete pods): the master only enqueues. A failed create is reported back as an exit."""

    def __init__(self, api, namespace: str, timeout_s: float, on_create_failed):
        self.api, self.namespace, self.timeout_s = api, namespace, timeout_s
        self.on_create_failed = on_create_failed
        self.calls: queue.Queue = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, daemon=True, name="pod-calls")
        self._thread.start()

    def _put(self, item) -> None:
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self.calls.put(item)

    def create(self, pod: k8s.V1Pod, worker_id: str) -> None:
        self._put(("create", pod, worker_id))

    def delete(self, name: str, attempt: int = 0) -> None:
        self._put(("delete", name, attempt))

    def wait_idle(self, timeout_s: float) -> bool:
        """Until every queued call is done (True) or `timeout_s` passed (False)."""
        return self._idle.wait(timeout_s)

    def close(self, timeout_s: float) -> None:
        self.calls.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            item = self.calls.get()
            if item is None:
                return
            kind, what, worker_id = item
            try:
                if kind == "create":
                    self._create(what, worker_id)
                else:
                    delete_pod(self.api, what, self.namespace, self.timeout_s, quiet=False)
            except Exception as exc:  # a dropped connection, a timeout: never the end of this thread
                log.warning("%s pod failed: %s", kind, exc)
                if kind == "create":
                    self.on_create_failed(worker_id, f"pod {what.metadata.name} not created: {exc}")
                    # The server may have made it all the same: it must not outlive its worker.
                    self.delete(what.metadata.name)
                else:
                    self._delete_again(what, worker_id)
            finally:
                with self._lock:
                    self._pending -= 1
                    if self._pending == 0:
                        self._idle.set()

    def _delete_again(self, name: str, attempt: int) -> None:
        if attempt >= len(DELETE_RETRY_S):
            log.error("pod %s could not be deleted after %d tries: delete it by hand (kubectl delete pod %s -n %s)",
                      name, attempt + 1, name, self.namespace)
            return
        retry = threading.Timer(DELETE_RETRY_S[attempt], self.delete, (name, attempt + 1))
        retry.daemon = True
        retry.start()

    def _create(self, pod: k8s.V1Pod, worker_id: str) -> None:
        name = pod.metadata.name
        try:
            self.api.create_namespaced_pod(self.namespace, pod, _request_timeout=self.timeout_s)
        except k8s.ApiException as exc:
            # Reported as an exit at the next poll: the master's relaunch limit applies. The
            # server's own words say why (an admission policy's, a quota's), not only its code.
            why = f"{exc.status} {exc.reason}" + (f": {status_message(exc)}" if status_message(exc) else "")
            log.warning("creating pod %s failed: %s", name, why)
            self.on_create_failed(worker_id, f"pod {name} not created: {why}")


def status_message(exc: k8s.ApiException) -> str:
    """The message of the Status an API error carries, on one line ("" without one)."""
    try:
        return " ".join(str(json.loads(exc.body).get("message") or "").split())[:500]
    except (TypeError, ValueError, AttributeError):
        return ""


def delete_pod(api, name: str, namespace: str, timeout_s: float, quiet: bool = True) -> None:
    """Delete the pod at once (grace 0); one already gone is deleted. Any other failure is logged
    (`quiet`, at the job's clean-up) or raised, for the caller to try again."""
    try:
        api.delete_namespaced_pod(name, namespace, grace_period_seconds=0, _request_timeout=timeout_s)
    except k8s.ApiException as exc:
        if exc.status == 404:
            return
        if not quiet:
            raise RuntimeError(f"deleting pod {name} failed: {exc.status} {exc.reason}") from None
        log.warning("deleting pod %s failed: %s %s", name, exc.status, exc.reason)
