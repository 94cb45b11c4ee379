"""Keeps an up-to-date view of this job's pods: list once, then watch from the list's
resourceVersion, resuming from the newest one seen; a 410 Gone (the server no longer has that
version) means re-list — and a pod that vanished meanwhile is reported as deleted."""

from __future__ import annotations

import logging
import queue
import threading
import time

from kubernetes import client as k8s
from kubernetes import watch

log = logging.getLogger("elastic_step.backends.kubernetes")


class PodWatcher:
    """A thread that turns the API's pod events into ("ADDED"|"MODIFIED"|"DELETED", V1Pod)
    items on `events`. A re-list replays every listed pod as MODIFIED and every known pod it no
    longer finds as DELETED, so the consumer never misses a transition across a gap."""

    def __init__(self, api, namespace: str, selector: str, watch_timeout_s: int = 30, retry_s: float = 1.0,
                 request_timeout_s: float = 30.0):
        self.api = api
        self.request_timeout_s = request_timeout_s
        self.namespace = namespace
        self.selector = selector
        self.watch_timeout_s = watch_timeout_s
        self.retry_s = retry_s
        self.events: queue.Queue[tuple[str, k8s.V1Pod]] = queue.Queue()
        self.resource_version: str | None = None
        self._known: dict[str, k8s.V1Pod] = {}
        self._stop = threading.Event()
        self._watch: watch.Watch | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="pod-watch")

    def start(self) -> None:
        self._relist()  # the first list in the caller's thread: an API error surfaces at once
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        self._thread.join(2.0)

    def _emit(self, kind: str, pod: k8s.V1Pod) -> None:
        if kind == "DELETED":
            self._known.pop(pod.metadata.name, None)
        else:
            self._known[pod.metadata.name] = pod
        self.events.put((kind, pod))

    def _relist(self) -> None:
        listed = self.api.list_namespaced_pod(self.namespace, label_selector=self.selector,
                                              _request_timeout=self.request_timeout_s)
        names = set()
        for pod in listed.items:
            names.add(pod.metadata.name)
            self._emit("MODIFIED", pod)
        for name, pod in list(self._known.items()):
            if name not in names:
                self._emit("DELETED", pod)
        self.resource_version = listed.metadata.resource_version

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.resource_version is None:
                    self._relist()
                self._watch = watch.Watch(return_type="V1Pod")
                for event in self._watch.stream(
                    self.api.list_namespaced_pod,
                    self.namespace,
                    label_selector=self.selector,
                    resource_version=self.resource_version,
                    timeout_seconds=self.watch_timeout_s,
                    # The server ends the watch after timeout_seconds; a cut connection ends no
                    # watch by itself: this client-side bound does, and the loop resumes.
                    _request_timeout=self.watch_timeout_s + self.request_timeout_s,
                    allow_watch_bookmarks=False,
                ):
                    if self._stop.is_set():
                        break
                    pod = event["object"]
                    self.resource_version = pod.metadata.resource_version or self.resource_version
                    self._emit(event["type"], pod)
            except k8s.ApiException as exc:
                if exc.status == 410:
                    log.info("pod watch expired at resourceVersion %s (410 Gone); re-listing", self.resource_version)
                    self.resource_version = None
                    continue
                log.warning("pod watch failed (%s %s); retrying in %.0fs", exc.status, exc.reason, self.retry_s)
                self._stop.wait(self.retry_s)
            except Exception as exc:  # a dropped connection: resume from the newest version seen
                if self._stop.is_set():
                    break
                log.warning("pod watch interrupted (%s); resuming", exc)
                self._stop.wait(self.retry_s)

    def drain(self) -> list[tuple[str, k8s.V1Pod]]:
        items = []
        while True:
            try:
                items.append(self.events.get_nowait())
            except queue.Empty:
                return items
