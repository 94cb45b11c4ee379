"""`pods/log` as the API server and the kubelet answer it (pkg/registry/core/pod/rest/log.go,
pkg/kubelet/kubelet_pods.go):
- `container` names one of the pod's containers or init containers; left out, the pod must have
  exactly one container, else 400 `a container name must be specified for pod P, choose one of: [...]`;
- `previous=true` is the log of the container's previous instance (after a restart in place), else
  400 `previous terminated container "C" in pod "P" not found`;
- `tailLines` keeps the newest lines; `follow=true` streams what the container writes (chunked)
  until it ends or the pod goes.
The kubelet reads the files (`ApiServer.log_reader(namespace, pod, container, previous)`)."""

from __future__ import annotations

import time

from .objects import ApiError

FOLLOW_POLL_S = 0.2


def container_of(pod: dict, requested: str | None) -> str:
    name, spec = pod["metadata"]["name"], pod.get("spec") or {}
    containers = [c["name"] for c in spec.get("containers") or []]
    inits = [c["name"] for c in spec.get("initContainers") or []]
    if not requested:
        if len(containers) == 1:
            return containers[0]
        message = f"a container name must be specified for pod {name}, choose one of: [{' '.join(containers)}]"
        if inits:
            message += f" or one of the init containers: [{' '.join(inits)}]"
        raise ApiError(400, "BadRequest", message)
    if requested not in containers + inits:
        raise ApiError(400, "BadRequest", f"container {requested} is not valid for pod {name}")
    return requested


def tail(text: bytes, lines: str | None) -> bytes:
    if lines is None:
        return text
    count = int(lines)
    kept = text.splitlines(keepends=True)
    return b"".join(kept[-count:]) if count > 0 else b""


def _ended(api, pod: dict, container: str) -> bool:
    meta = pod["metadata"]
    with api.store.cond:
        current = api.store.objects.get(("pods", meta["namespace"], meta["name"]))
        if current is None or current["metadata"]["uid"] != meta["uid"] or api.closed:
            return True
        status = current.get("status") or {}
        states = [s for s in (status.get("containerStatuses") or []) + (status.get("initContainerStatuses") or [])
                  if s["name"] == container]
        return bool(states) and "terminated" in (states[0].get("state") or {})


def serve(handler, api, pod: dict, query: dict) -> None:
    """Answer one pods/log request on `handler` (apiserver._Handler)."""
    namespace, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
    container = container_of(pod, query.get("container"))
    previous = str(query.get("previous")).lower() in ("true", "1")
    text = api.log_reader(namespace, name, container, previous)
    if str(query.get("follow")).lower() not in ("true", "1") or previous:
        return handler._send(200, tail(text, query.get("tailLines")), "text/plain")
    handler.send_response(200)
    handler.send_header("Content-Type", "text/plain")
    handler.send_header("Transfer-Encoding", "chunked")
    handler.end_headers()

    def chunk(data: bytes) -> None:
        if data:
            handler.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            handler.wfile.flush()

    sent = len(text)
    chunk(tail(text, query.get("tailLines")))
    try:
        while True:
            ended = _ended(api, pod, container)  # read before the file, so the last lines are never missed
            try:
                text = api.log_reader(namespace, name, container, False)
            except ApiError:
                break  # the pod left the node
            chunk(text[sent:])
            sent = max(sent, len(text))
            if ended:
                break
            time.sleep(FOLLOW_POLL_S)
        handler.wfile.write(b"0\r\n\r\n")
        handler.wfile.flush()
    except (BrokenPipeError, ConnectionResetError, OSError):
        handler.close_connection = True  # the client stopped following
