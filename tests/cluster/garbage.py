"""The API server's garbage collector: an object all of whose owners are gone is deleted, owners
being looked up by UID in the dependent's own namespace only (a cross-namespace owner reference
is dangling, as Kubernetes treats it). A running pod so deleted is deleted gracefully (the
kubelet finishes it); an object with finalizers waits for them."""

from __future__ import annotations

import logging

log = logging.getLogger("cluster.apiserver")


def collect(server) -> None:
    """Delete every object whose owners are all absent from its own namespace; `server`'s
    (apiserver.ApiServer) store lock is held by the caller."""
    store = server.store
    while True:
        uids = {}
        for (_, ns, _), o in store.objects.items():
            uids.setdefault(ns, set()).add(o["metadata"].get("uid"))
        doomed = []
        for (plural, ns, name), o in store.objects.items():
            refs = o["metadata"].get("ownerReferences") or []
            if refs and not any(r.get("uid") in uids.get(ns, set()) for r in refs) and not o["metadata"].get("deletionTimestamp"):
                doomed.append((plural, ns, name))
        if not doomed:
            return
        for plural, ns, name in doomed:  # a running pod or a finalized object is marked, and skipped next round
            log.info("garbage collector: deleting %s %s/%s (owner gone from its namespace)", plural, ns, name)
            server._delete(plural, ns, name, orphan=True)
