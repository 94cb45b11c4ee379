"""A Kubernetes API server stand-in over HTTPS on 127.0.0.1, for the real `kubernetes` client and
for kubectl.

It serves the resources of discovery.py (pods with their status, binding, log and eviction
subresources, secrets, configmaps, serviceaccounts and their tokens, services, events, resource
quotas, namespaces, nodes, network policies, priority classes, RBAC objects, Argo's workflows and
task results), storing each object as the JSON dict the client sent, with `metadata.uid`,
`creationTimestamp` and a cluster-wide `resourceVersion`; discovery and OpenAPI (discovery.py).

As the real server does:
- every request is authenticated by its bearer token and authorized by RBAC (rbac.py); a refusal
  is a 403 `Status`; every (user, verb, resource, namespace) is recorded for assertions; Roles and
  bindings created, changed or deleted through the API take effect at once;
- a list answer carries the collection's resourceVersion; a watch (`?watch=true`) streams JSON
  lines over a chunked response from that version (watching.py), ends after `timeoutSeconds`,
  and answers a version older than its compacted history with an `ERROR` event carrying `410 Gone`;
  label selectors are equality- and set-based (labels.py); `Accept: ...;as=Table` gets the Table
  kubectl prints (tables.py);
- PATCH is a JSON merge, JSON or strategic merge patch, or a server-side apply, by its Content-Type (patches.py);
  `fieldValidation=Strict` refuses unknown fields; a protobuf body of the kinds kubectl's typed
  clients send is read (protowire.py);
- pod deletion is graceful (deletionTimestamp = now + grace, then the kubelet's final delete)
  unless the grace period is 0, the pod is unbound, or it has finished; the Eviction API marks the
  pod DisruptionTarget first; an object with finalizers stays, marked, until they are removed;
- admission (admission.py): defaults, the pod's ServiceAccount and token, PodSecurity on a
  labelled namespace, ResourceQuota; every user's create, update and delete judged by the
  ValidatingAdmissionPolicies stored, their CEL evaluated;
- the garbage collector (garbage.py) deletes an object all of whose owners are gone, looking owners
  up by UID in the dependent's own namespace only (so a cross-namespace owner reference is dangling);
- created objects are validated against the Kubernetes OpenAPI schema (422 Invalid);
- `?dryRun=All` on a create, update, patch (server-side apply's too), delete or eviction answers
  as the request would, through the same validation and admission, and changes nothing: no
  resourceVersion, no watch event, no grant (`kubectl apply|create|delete --dry-run=server`).

Not modelled: admission webhooks, LimitRanges, managed fields but server-side apply's, impersonation.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import logging
import ssl
import threading
import time
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import yaml

from . import discovery, garbage, logs, protowire, tables, watching
from .discovery import GROUP_OF, GROUP_VERSIONS, RESOURCES, SUBRESOURCES
from .admission import admit_by_policies, admit_pod
from .objects import ApiError, Store, field_matches, label_matches, not_found, now_text
from .patches import apply_patch, is_apply
from .rbac import REVIEWS, Authorizer, Request, forbidden_message, pod_bound_extra, review

log = logging.getLogger("cluster.apiserver")

class ApiServer:
    """The server; start() it, then point clients at `url` with a token from `authorizer`."""

    def __init__(self, authorizer: Authorizer, certfile: str, keyfile: str, validate: bool = True):
        self.authorizer = authorizer
        self.store = Store()
        self.audit: list[tuple[str, str, str, str, bool]] = []  # (user, verb, resource, namespace, allowed)
        self.validate = validate
        self.log_reader = None  # (namespace, pod) -> bytes, set by the kubelet: `pods/log`
        self.installed: set[str] = set()  # the groups of optional CRDs installed (discovery.Resource.optional)
        self.mutators: list = []  # mutating admission webhooks' stand-ins (sidecar.py): f(store, namespace, pod), before admit_pod
        self.closed = False
        self.ssl = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ssl.load_cert_chain(certfile, keyfile)
        self.httpd = _Server(("127.0.0.1", 0), _Handler)
        self.httpd.api = self
        self.port = self.httpd.server_address[1]
        self.url = f"https://127.0.0.1:{self.port}"
        self._threads = [threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True, name="apiserver"),
                         threading.Thread(target=self._gc_loop, daemon=True, name="apiserver-gc")]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        self.closed = True
        self.drop_watches()
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- what a test does to the server itself ----------------------------------------------------
    def install(self, group: str) -> None:
        """Serve an optional CRD's group from now on, as `kubectl apply` of its CRD does."""
        self.installed.add(group)

    def compact(self) -> None:
        """Forget the watch history and drop every open watch: resuming gets 410 Gone."""
        with self.store.cond:
            self.store.oldest_rv = self.store.rv  # events after the current version are still to come
            self.store.history.clear()
            self.store.generation += 1
            self.store.cond.notify_all()

    def drop_watches(self) -> None:
        """Every open watch connection breaks (a network cut, an API server restart)."""
        with self.store.cond:
            self.store.generation += 1
            self.store.cond.notify_all()

    def used(self, user: str, allowed_only: bool = True) -> set[tuple[str, str, str]]:
        """(verb, resource, namespace) of every request `user` made."""
        return {(verb, res, ns) for u, verb, res, ns, ok in list(self.audit) if u == user and (ok or not allowed_only)}

    def objects(self, plural: str, namespace: str | None = None) -> list[dict]:
        with self.store.cond:
            return [copy.deepcopy(o) for (p, ns, _), o in self.store.objects.items()
                    if p == plural and (namespace is None or ns == namespace)]

    def get(self, plural: str, namespace: str, name: str) -> dict | None:
        with self.store.cond:
            obj = self.store.objects.get((plural, namespace, name))
            return copy.deepcopy(obj) if obj else None

    # -- storage operations (the lock held by the caller) -----------------------------------------
    def _create(self, plural: str, namespace: str, body: dict, strict: bool = False, user: str | None = None,
                dry_run: bool = False) -> dict:
        group = GROUP_OF[plural]
        resource = RESOURCES[(group, plural)]
        kind, namespaced = resource.kind, resource.namespaced
        store = self.store
        if body.get("kind") not in (None, kind):
            raise ApiError(400, "BadRequest", f"the object provided is a {body.get('kind')}, not a {kind}")
        meta = body.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if not meta.get("name"):
            raise ApiError(422, "Invalid", f"{kind} is invalid: metadata.name: Required value")
        if namespaced:
            if meta.get("namespace") not in (None, namespace):
                raise ApiError(400, "BadRequest", "the namespace of the provided object does not match the namespace sent on the request")
            if ("namespaces", "", namespace) not in store.objects:
                raise ApiError(404, "NotFound", f'namespaces "{namespace}" not found', {"name": namespace, "kind": "namespaces"})
            meta["namespace"] = namespace
        if (plural, meta.get("namespace", ""), meta["name"]) in store.objects:
            raise ApiError(409, "AlreadyExists", f'{plural} "{meta["name"]}" already exists', {"name": meta["name"], "kind": plural})
        body["kind"], body["apiVersion"] = kind, GROUP_VERSIONS.get(group, f"{group}/v1")
        if plural == "pods":
            for mutate in self.mutators:
                mutate(store, namespace, body)
            admit_pod(store, namespace, body)
        if plural == "namespaces":
            body["status"] = {"phase": "Active"}
        if plural == "secrets" and body.get("stringData"):
            data = body.setdefault("data", {})
            for key, value in body.pop("stringData").items():
                data[key] = base64.b64encode(value.encode()).decode()
        if self.validate and resource.schema:  # a CRD's schema is not in Kubernetes' own
            discovery.validate(body, strict)
        admit_by_policies(store, user, "CREATE", group, plural, namespace if namespaced else "", body, None)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_text()
        if resource.generation:
            meta["generation"] = 1
        meta.pop("deletionTimestamp", None)
        if dry_run:  # admitted and validated, as it would be stored: but not stored (no resourceVersion)
            return body
        self._rbac_changed(body)
        return store.commit("ADDED", plural, body)

    def _rbac_changed(self, obj: dict, deleted: bool = False) -> None:
        """RBAC objects made through the API grant at once, as the RBAC authorizer's informers see them."""
        if obj.get("apiVersion", "").startswith("rbac.authorization.k8s.io/"):
            (self.authorizer.remove if deleted else self.authorizer.apply)(obj)

    def _modified(self, plural: str, obj: dict, dry_run: bool = False) -> dict:
        """An update's commit; an object being deleted whose last finalizer just went is removed."""
        if dry_run:  # the caller built `obj` afresh: the stored object is untouched
            return obj
        meta = obj["metadata"]
        self._rbac_changed(obj)
        finished = meta.get("deletionTimestamp") and not meta.get("finalizers") and (
            plural != "pods" or meta.get("deletionGracePeriodSeconds") == 0)
        self.store.commit("MODIFIED", plural, obj)
        if finished:
            return self._delete(plural, meta.get("namespace", ""), meta["name"], grace=0)
        return obj

    def _delete(self, plural: str, namespace: str, name: str, grace: int | None = None, orphan: bool = False,
                dry_run: bool = False) -> dict:
        store = self.store
        obj = store.objects.get((plural, namespace, name))
        if obj is None:
            raise not_found(plural, name)
        if dry_run:  # the object as it stands: nothing marked, nothing removed, no dependent collected
            return copy.deepcopy(obj)
        if plural == "pods":
            spec, status = obj.get("spec", {}), obj.get("status", {})
            if grace is None:
                grace = spec.get("terminationGracePeriodSeconds", 30)
            if not spec.get("nodeName") or status.get("phase") in ("Succeeded", "Failed"):
                grace = 0
            if grace > 0:
                meta = obj["metadata"]
                if not meta.get("deletionTimestamp"):  # the time by which it is to be gone, as the server sets it
                    meta["deletionTimestamp"] = now_text(after_s=grace)
                    meta["deletionGracePeriodSeconds"] = grace
                    store.commit("MODIFIED", plural, obj)
                return copy.deepcopy(obj)  # the kubelet deletes it for good once its containers stopped
        meta = obj["metadata"]
        if meta.get("finalizers"):  # kept, marked, until its finalizers' controllers remove them
            if not meta.get("deletionTimestamp") or meta.get("deletionGracePeriodSeconds") != 0:
                meta.setdefault("deletionTimestamp", now_text())
                meta["deletionGracePeriodSeconds"] = 0
                store.commit("MODIFIED", plural, obj)
            return copy.deepcopy(obj)
        if plural == "namespaces":
            for key in [k for k in store.objects if k[1] == name]:
                self._delete(key[0], key[1], key[2], grace=0, orphan=True)
        store.commit("DELETED", plural, obj)
        self._rbac_changed(obj, deleted=True)
        if not orphan:
            garbage.collect(self)
        return copy.deepcopy(obj)

    def _gc_loop(self) -> None:
        while not self.closed:
            time.sleep(0.5)
            with self.store.cond:
                garbage.collect(self)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    api: ApiServer

    def get_request(self):
        sock, addr = self.socket.accept()
        # The TLS handshake happens in the request's own thread, not in the accept loop.
        return self.api.ssl.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr



def dry_run(query: dict, options: dict | None = None) -> bool:
    """`?dryRun=All`, or a DeleteOptions body's `dryRun: [All]` (kubectl delete's): the request is
    judged and answered, nothing is stored. All is the only value there is."""
    values = [query["dryRun"]] if query.get("dryRun") else list((options or {}).get("dryRun") or [])
    for value in values:
        if value != "All":
            raise ApiError(422, "Invalid", f'dryRun: Unsupported value: "{value}": supported values: "All"')
    return bool(values)


def as_authorized(req: Request) -> Request:
    """The request as RBAC judges it. Kubernetes' RequestInfo takes `/api/v1/namespaces/NAME` as a
    request in namespace NAME (a namespaced Role may grant `get` on its own namespace), though the
    object is cluster-wide."""
    if req.resource == "namespaces" and req.name and not req.namespace:
        return dataclasses.replace(req, namespace=req.name)
    return req

class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, fmt, *args):  # quiet: the audit list records what matters
        pass

    def handle(self):
        try:
            self.connection.do_handshake()
        except (ssl.SSLError, OSError):
            return
        super().handle()

    # -- plumbing ---------------------------------------------------------------------------------
    def _send(self, code: int, body: dict | bytes, content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict:
        if not self._raw:
            return {}
        if (self.headers.get("Content-Type") or "").startswith(protowire.PROTOBUF):
            return protowire.decode(self._raw)
        if is_apply(self.headers.get("Content-Type")):  # server-side apply's body is YAML (JSON is YAML too)
            try:
                return yaml.safe_load(self._raw)
            except yaml.YAMLError as exc:
                raise ApiError(400, "BadRequest", f"the apply patch is not YAML: {exc}") from None
        try:
            return json.loads(self._raw)
        except json.JSONDecodeError as exc:
            raise ApiError(400, "BadRequest", f"the body is not JSON: {exc}") from None

    def do_GET(self):
        self._serve("GET")

    def do_POST(self):
        self._serve("POST")

    def do_PUT(self):
        self._serve("PUT")

    def do_PATCH(self):
        self._serve("PATCH")

    def do_DELETE(self):
        self._serve("DELETE")

    def _route(self, method: str):  # the request as it is served; as_authorized: as RBAC judges it
        parsed = urllib.parse.urlsplit(self.path)
        query = {k: v[-1] for k, v in urllib.parse.parse_qs(parsed.query).items()}
        parts = [p for p in parsed.path.split("/") if p]
        if parts[:2] == ["api", "v1"]:
            group, rest = "", parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis" and (parts[2] == "v1" or GROUP_VERSIONS.get(parts[1]) == f"{parts[1]}/{parts[2]}"):
            group, rest = parts[1], parts[3:]
        else:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({parsed.path})")
        namespace = ""
        if len(rest) >= 2 and rest[0] == "namespaces" and len(rest) != 2:
            namespace, rest = rest[1], rest[2:]
        optional = RESOURCES.get((group, rest[0] if rest else ""))
        if optional is not None and optional.optional and group not in self.server.api.installed:
            rest = []  # a CRD not installed: its group is not served
        if not rest or ((group, rest[0]) not in RESOURCES and (group, rest[0]) not in REVIEWS):
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({parsed.path})")
        plural, name = rest[0], rest[1] if len(rest) > 1 else ""
        sub = rest[2] if len(rest) > 2 else ""
        if sub and (plural, sub) not in SUBRESOURCES:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({parsed.path})")
        if not name:
            verb = {"GET": "watch" if str(query.get("watch")).lower() in ("true", "1") else "list", "POST": "create",
                    "DELETE": "deletecollection"}.get(method)
        else:
            verb = {"GET": "get", "PUT": "update", "PATCH": "patch", "DELETE": "delete", "POST": "create"}.get(method)
        if verb is None:
            raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on {parsed.path}")
        return Request(verb, group, f"{plural}/{sub}" if sub else plural, namespace, name), query

    def _serve(self, method: str) -> None:
        api = self.server.api
        # Read the whole body first, whatever the answer: the connection is kept alive.
        self._raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            if self._discovery(method):
                return
            req, query = self._route(method)
            label_matches({}, query.get("labelSelector"))  # a selector that does not parse is a 400 before anything
            user = api.authorizer.user_of(self.headers.get("Authorization"))
            if user is None:
                raise ApiError(401, "Unauthorized", "Unauthorized")
            allowed = api.authorizer.allowed(user, as_authorized(req))
            api.audit.append((user, req.verb, req.resource, req.namespace, allowed))
            if not allowed:
                resource = req.resource.split("/")[0]
                raise ApiError(403, "Forbidden", forbidden_message(user, req), {"name": req.name, "kind": resource})
            if (req.api_group, req.resource) in REVIEWS:
                return self._review(user, req)
            if req.verb == "watch":
                return watching.serve(self, req, query)
            if req.resource == "pods/log":
                return self._log(req, query)
            code, body = self._dispatch(method, req, query, user)
            if tables.wants_table(self.headers.get("Accept")) and req.verb in ("get", "list") and body.get("kind") != "Status":
                items = body["items"] if req.verb == "list" else [body]
                body = tables.table(req.resource, items, body["metadata"].get("resourceVersion", ""), query.get("includeObject"))
            self._send(code, body)
        except ApiError as exc:
            self._send(exc.body["code"], exc.body)
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            self.close_connection = True

    def _discovery(self, method: str) -> bool:
        """Discovery and OpenAPI (discovery.py): for any authenticated user, `/version` for anyone."""
        path = urllib.parse.urlsplit(self.path).path
        answer = discovery.serve(path, self.headers.get("Accept", ""), f"127.0.0.1:{self.server.api.port}",
                                 frozenset(self.server.api.installed)) if method == "GET" else None
        if answer is None:
            return False
        if path.rstrip("/") != "/version" and self.server.api.authorizer.user_of(self.headers.get("Authorization")) is None:
            raise ApiError(401, "Unauthorized", "Unauthorized")
        code, body = answer
        self._send(code, body, "application/json" if code == 200 else "text/plain")
        return True

    def _log(self, req: Request, query: dict) -> None:
        """pods/log (logs.py): one container's log, its previous instance's, the newest lines, followed."""
        api = self.server.api
        if api.log_reader is None:
            raise ApiError(400, "BadRequest", f'pod "{req.name}" has no node to read logs from')
        with api.store.cond:
            pod = copy.deepcopy(api.store.objects.get(("pods", req.namespace, req.name)))
        if pod is None:
            raise not_found("pods", req.name)
        logs.serve(self, api, pod, query)

    def _review(self, user: str, req: Request) -> None:
        """A review the caller asks about itself (rbac.review): only `create`, as the real server."""
        if req.verb != "create" or req.name:
            raise ApiError(405, "MethodNotAllowed", f"{req.verb} is not supported on {req.resource}")
        self._send(201, review(self.server.api.authorizer, user, req.api_group, req.resource, self._body()))

    def _apply_create(self, req: Request, query: dict, user: str, dry: bool):
        """Server-side apply of an object that does not exist: it is created, if the caller may create."""
        api, plural = self.server.api, req.resource
        create = Request("create", req.api_group, plural, req.namespace, "")
        if not api.authorizer.allowed(user, create):
            raise ApiError(403, "Forbidden", forbidden_message(user, create), {"name": req.name, "kind": plural})
        body = self._body()
        if not isinstance(body, dict) or (body.get("metadata") or {}).get("name") != req.name:
            raise ApiError(400, "BadRequest", "the name of the object in the apply patch does not match the name on the URL")
        body = apply_patch(self.headers.get("Content-Type"), None, body, RESOURCES[(req.api_group, plural)].kind, query)
        return 201, copy.deepcopy(api._create(plural, req.namespace, body, query.get("fieldValidation") == "Strict", user, dry))

    def _dispatch(self, method: str, req: Request, query: dict, user: str):
        api, store = self.server.api, self.server.api.store
        plural, _, sub = req.resource.partition("/")
        key = (plural, req.namespace, req.name)
        dry = req.verb not in ("get", "list") and dry_run(query)
        with store.cond:
            if req.verb == "create" and not sub:
                strict = query.get("fieldValidation") == "Strict"
                return 201, copy.deepcopy(api._create(plural, req.namespace, self._body(), strict, user, dry))
            if req.verb == "list":
                items = [copy.deepcopy(o) for (p, ns, _), o in store.objects.items()
                         if p == plural and (not req.namespace or ns == req.namespace)
                         and label_matches(o["metadata"].get("labels"), query.get("labelSelector"))
                         and field_matches(o, query.get("fieldSelector"))]
                kind = RESOURCES[(req.api_group, plural)].kind
                return 200, {"kind": f"{kind}List", "apiVersion": "v1", "metadata": {"resourceVersion": str(store.rv)}, "items": items}
            obj = store.objects.get(key)
            if obj is None and req.verb == "patch" and not sub and is_apply(self.headers.get("Content-Type")):
                return self._apply_create(req, query, user, dry)
            if obj is None:
                raise not_found(plural, req.name)
            if req.verb == "get" and not sub:
                return 200, copy.deepcopy(obj)
            if req.verb == "delete":
                body = self._body()
                grace = query.get("gracePeriodSeconds", body.get("gracePeriodSeconds"))
                orphan = (query.get("propagationPolicy") or body.get("propagationPolicy")) == "Orphan"
                admit_by_policies(store, user, "DELETE", req.api_group, plural, req.namespace, None, obj)
                return 200, api._delete(plural, req.namespace, req.name, None if grace is None else int(grace), orphan,
                                        dry or dry_run({}, body))
            if sub == "eviction":
                # The Eviction API (`kubectl drain`): the pod is marked as disrupted, then deleted gracefully.
                options = self._body().get("deleteOptions") or {}
                grace = options.get("gracePeriodSeconds")
                if dry or dry_run({}, options):
                    return 201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
                if obj.get("status", {}).get("phase") not in ("Succeeded", "Failed"):
                    conditions = [c for c in obj.setdefault("status", {}).get("conditions", []) if c["type"] != "DisruptionTarget"]
                    conditions.append({"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
                                       "message": "Eviction API: evicting", "lastTransitionTime": now_text()})
                    obj["status"]["conditions"] = conditions
                    store.commit("MODIFIED", plural, obj)
                api._delete(plural, req.namespace, req.name, None if grace is None else int(grace))
                return 201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
            if sub == "binding":
                target = self._body().get("target", {})
                if obj["spec"].get("nodeName"):
                    raise ApiError(409, "Conflict", f'pod {req.name} is already assigned to node "{obj["spec"]["nodeName"]}"')
                if dry:
                    return 201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
                obj["spec"]["nodeName"] = target.get("name")
                status = obj.setdefault("status", {})
                status["conditions"] = [c for c in status.get("conditions", []) if c["type"] != "PodScheduled"] + [
                    {"type": "PodScheduled", "status": "True", "lastTransitionTime": now_text()}]
                store.commit("MODIFIED", plural, obj)
                return 201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
            if sub == "token":
                user = f"system:serviceaccount:{req.namespace}:{req.name}"
                body = self._body()
                bound = (body.get("spec") or {}).get("boundObjectRef") or {}  # a pod's token: its name and uid in extra
                token = api.authorizer.issue_token(user, pod_bound_extra(bound["name"], bound.get("uid", ""))
                                                   if bound.get("kind") == "Pod" else None)
                body.setdefault("status", {}).update(token=token, expirationTimestamp=now_text())
                return 201, body
            if req.verb in ("update", "patch"):
                body = self._body()
                if req.verb == "patch":
                    body = apply_patch(self.headers.get("Content-Type"), obj, body, obj["kind"], query)
                sent_rv = body.get("metadata", {}).get("resourceVersion")
                if req.verb == "update" and sent_rv and sent_rv != obj["metadata"]["resourceVersion"]:
                    raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {plural} "{req.name}": the object has been '
                                                    "modified; please apply your changes to the latest version and try again")
                if sub == "status":
                    obj = {**obj, "status": body.get("status", {})}  # a new object: the stored one changes at the commit only
                else:
                    # the writable metadata is the body's (a key left out is removed), the rest the server's
                    writable = ("labels", "annotations", "ownerReferences", "finalizers")
                    if "managedFields" in body.get("metadata", {}):  # sent: replaced (server-side apply's); left out: kept
                        writable += ("managedFields",)
                    body["metadata"] = {**{k: v for k, v in obj["metadata"].items() if k not in writable},
                                        **{k: v for k, v in body.get("metadata", {}).items() if k in writable}}
                    if plural == "pods":
                        body["status"] = obj.get("status", {})
                    if RESOURCES[(req.api_group, plural)].generation:  # spec changes count; status is /status's
                        generation = obj["metadata"].get("generation", 1)
                        body["metadata"]["generation"] = generation + (body.get("spec") != obj.get("spec"))
                        body["status"] = obj.get("status", {})
                    if body == obj:  # a write that changes nothing changes no resourceVersion either
                        return 200, copy.deepcopy(obj)
                    admit_by_policies(store, user, "UPDATE", req.api_group, plural, req.namespace, body, obj)
                    obj = body
                return 200, copy.deepcopy(api._modified(plural, obj, dry))
        raise ApiError(405, "MethodNotAllowed", f"{req.verb} on {req.resource} is not supported")
