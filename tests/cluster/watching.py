"""Watches (`?watch=true`) as the API server streams them: JSON lines over a chunked response,
from the requested resourceVersion (`0`: the current state as ADDED events first), filtered by
label and field selectors, each object a one-row Table when kubectl asks for one (`get --watch`),
ended after `timeoutSeconds` (with a BOOKMARK when asked), an `ERROR` 410 Gone for a version older
than the compacted history, dropped mid-stream when the server drops every watch."""

from __future__ import annotations

import copy
import json
import socket
import ssl
import time

from . import tables
from .discovery import RESOURCES
from .objects import field_matches, label_matches, status_body


def serve(handler, req, query: dict) -> None:
    """Stream one watch on `handler` (apiserver._Handler) until its timeout, a dropped connection or 410."""
    store = handler.server.api.store
    plural = req.resource
    timeout = float(query.get("timeoutSeconds") or 1800)
    deadline = time.monotonic() + timeout
    rv_text = query.get("resourceVersion") or "0"
    selector, fields = query.get("labelSelector"), query.get("fieldSelector")
    bookmarks = str(query.get("allowWatchBookmarks")).lower() in ("true", "1")

    def wanted(entry) -> bool:
        _, p, ns, _, obj = entry
        return (p == plural and (not req.namespace or ns == req.namespace)
                and label_matches(obj["metadata"].get("labels"), selector) and field_matches(obj, fields))

    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Transfer-Encoding", "chunked")
    handler.end_headers()

    as_table = tables.wants_table(handler.headers.get("Accept"))

    def printed(event: dict) -> dict:  # `kubectl get --watch`: each object a one-row Table
        if not as_table or event["type"] in ("ERROR", "BOOKMARK"):
            return event
        obj = event["object"]
        return {"type": event["type"], "object": tables.table(plural, [obj], obj["metadata"].get("resourceVersion", ""),
                                                              query.get("includeObject"))}

    def chunk(events: list[dict]) -> None:
        data = b"".join(json.dumps(printed(e)).encode() + b"\n" for e in events)
        handler.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        handler.wfile.flush()

    try:
        with store.cond:
            generation = store.generation
            initial = []
            if rv_text == "0":  # "any version": the current state as ADDED events first
                cursor = store.rv
                initial = [{"type": "ADDED", "object": copy.deepcopy(o)} for (p, ns, n), o in store.objects.items()
                           if wanted((0, p, ns, "", o))]
            else:
                cursor = int(rv_text)
                if cursor < store.oldest_rv:
                    gone = status_body(410, "Expired", f"too old resource version: {cursor} ({store.oldest_rv})")
                    initial = [{"type": "ERROR", "object": gone}]
                    deadline = 0
        if initial:
            chunk(initial)
        while time.monotonic() < deadline:
            with store.cond:
                if store.generation != generation:
                    handler.close_connection = True
                    handler.connection.shutdown(socket.SHUT_RDWR)  # dropped mid-stream: no terminating chunk
                    return
                pending = [e for e in store.history if e[0] > cursor]
                if not pending:
                    store.cond.wait(min(0.5, max(0.0, deadline - time.monotonic())))
                    continue
                cursor = pending[-1][0]
                events = [{"type": kind, "object": obj} for entry in pending if wanted(entry) for _, _, _, kind, obj in [entry]]
            if events:
                chunk(events)
        if bookmarks:
            chunk([{"type": "BOOKMARK", "object": {"kind": RESOURCES[(req.api_group, plural)].kind, "apiVersion": "v1",
                                                    "metadata": {"resourceVersion": str(cursor)}}}])
        handler.wfile.write(b"0\r\n\r\n")
        handler.wfile.flush()
    except (BrokenPipeError, ConnectionResetError, ssl.SSLError, OSError):
        handler.close_connection = True
