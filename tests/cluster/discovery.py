"""What the API server stand-in serves and how a client finds it out: the resource table, legacy
discovery (`/version`, `/api`, `/apis`, `/api/v1`, `/apis/GROUP/VERSION`) and OpenAPI v2 and v3,
the schemas being Kubernetes' own (the ones the `kubernetes-validate` package ships, which the
server also validates created objects against).

As kube-apiserver answers them (staging/src/k8s.io/apiserver/pkg/endpoints/discovery,
k8s.io/kube-openapi/pkg/handler3):
- `/api` is an APIVersions, `/apis` an APIGroupList, each group version an APIResourceList with
  every resource's and subresource's kind, verbs, short names and categories — what kubectl's
  RESTMapper reads to turn `po` or `pods` into a path. Aggregated discovery (`apidiscovery.k8s.io/v2`)
  is not served: a client that asks for it gets the legacy documents with plain `application/json`,
  and falls back to them as kubectl does.
- `/openapi/v3` lists one document per group version (`serverRelativeURL` with a hash); each is an
  OpenAPI 3.0 document whose paths carry `x-kubernetes-group-version-kind` and the `fieldValidation`
  query parameter on PATCH, which is how kubectl decides to leave validation to the server
  (`--validate=strict` sends `fieldValidation=Strict`).
- `/openapi/v2` is the Swagger 2.0 document, in JSON only: a client asking for protobuf alone is
  answered 406 Not Acceptable.
Not modelled: aggregated discovery, protobuf, ETags and 304s.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass

from .objects import ApiError

KUBERNETES_VERSION = "1.32.0"  # the schema release served; kubectl v1.32 is within its skew
SCHEMA_VERSION = "1.30.0"  # what created objects are validated against (kubernetes_validate)


@dataclass(frozen=True)
class Resource:
    group: str
    plural: str
    kind: str
    namespaced: bool
    short_names: tuple[str, ...] = ()
    version: str = "v1"
    verbs: tuple[str, ...] = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")
    categories: tuple[str, ...] = ()
    schema: bool = True  # validated against Kubernetes' schema (a CRD's is not in it)
    # spec/status split: metadata.generation counts spec changes, and an update of the object
    # keeps its status (written through /status only), as for Deployments and CRs with a status
    generation: bool = False
    optional: bool = False  # a CRD served only once a test installs it (ApiServer.installed)

    @property
    def group_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def singular(self) -> str:
        return self.kind.lower()


_RBAC = "rbac.authorization.k8s.io"
RESOURCE_LIST = [
    Resource("", "pods", "Pod", True, ("po",), categories=("all",)),
    Resource("", "secrets", "Secret", True),
    Resource("", "configmaps", "ConfigMap", True, ("cm",)),
    Resource("", "serviceaccounts", "ServiceAccount", True, ("sa",)),
    Resource("", "services", "Service", True, ("svc",), categories=("all",)),
    Resource("", "events", "Event", True, ("ev",)),
    Resource("", "resourcequotas", "ResourceQuota", True, ("quota",)),
    Resource("", "namespaces", "Namespace", False, ("ns",)),
    Resource("", "nodes", "Node", False, ("no",)),  # the kubelet's one node, its allocatable read by the scheduler
    Resource("networking.k8s.io", "networkpolicies", "NetworkPolicy", True, ("netpol",)),
    Resource("scheduling.k8s.io", "priorityclasses", "PriorityClass", False, ("pc",)),  # read by `elastic-step submit`
    Resource("policy", "poddisruptionbudgets", "PodDisruptionBudget", True, ("pdb",)),  # stored, not enforced by evictions
    Resource(_RBAC, "roles", "Role", True),
    Resource(_RBAC, "rolebindings", "RoleBinding", True),
    Resource(_RBAC, "clusterroles", "ClusterRole", False),
    Resource(_RBAC, "clusterrolebindings", "ClusterRoleBinding", False),
    # judged by admission.admit_by_policies
    Resource("admissionregistration.k8s.io", "validatingadmissionpolicies", "ValidatingAdmissionPolicy", False),
    Resource("admissionregistration.k8s.io", "validatingadmissionpolicybindings", "ValidatingAdmissionPolicyBinding", False),
    # Argo's custom resources, as its CRDs install them (served, stored, not schema-validated here)
    Resource("argoproj.io", "workflows", "Workflow", True, ("wf",), "v1alpha1", schema=False),
    Resource("argoproj.io", "workflowtaskresults", "WorkflowTaskResult", True, (), "v1alpha1", schema=False),
    # Deployments and their ReplicaSets (run by apps.py's controllers when a test starts them)
    Resource("apps", "deployments", "Deployment", True, ("deploy",), categories=("all",), generation=True),
    Resource("apps", "replicasets", "ReplicaSet", True, ("rs",), categories=("all",), generation=True),
    # KServe's InferenceService, as its CRD installs it: absent until a test installs it (kserve.py)
    Resource("serving.kserve.io", "inferenceservices", "InferenceService", True, ("isvc",), "v1beta1", schema=False,
             generation=True, optional=True),
]
RESOURCES = {(r.group, r.plural): r for r in RESOURCE_LIST}
GROUP_OF = {r.plural: r.group for r in RESOURCE_LIST}  # every plural served is in one group
GROUP_VERSIONS = {r.group: r.group_version for r in RESOURCE_LIST}
# (plural, subresource) -> (kind, verbs)
SUBRESOURCES = {
    ("nodes", "status"): ("Node", ("get", "patch", "update")),
    ("pods", "status"): ("Pod", ("get", "patch", "update")),
    ("pods", "binding"): ("Binding", ("create",)),
    ("pods", "log"): ("Pod", ("get",)),
    ("pods", "eviction"): ("policy/v1/Eviction", ("create",)),  # `kubectl drain` looks for it here
    ("serviceaccounts", "token"): ("TokenRequest", ("create",)),
    ("deployments", "status"): ("Deployment", ("get", "patch", "update")),
    ("replicasets", "status"): ("ReplicaSet", ("get", "patch", "update")),
    ("inferenceservices", "status"): ("InferenceService", ("get", "patch", "update")),
}
# The reviews a user asks about itself (rbac.REVIEWS): create-only, cluster-scoped.
REVIEW_GROUPS = {"authorization.k8s.io": ["selfsubjectaccessreviews", "selfsubjectrulesreviews"],
                 "authentication.k8s.io": ["selfsubjectreviews"]}


def served_group_versions(installed: frozenset[str] = frozenset()) -> list[str]:
    """`installed`: the groups of optional CRDs a test installed."""
    built_in = {r.group_version for r in RESOURCE_LIST if not r.optional or r.group in installed}
    return sorted({*built_in, *(f"{g}/v1" for g in REVIEW_GROUPS)} - {"v1"})


# -- discovery documents ----------------------------------------------------------------------------
def version() -> dict:
    major, minor, _ = KUBERNETES_VERSION.split(".")
    return {"major": major, "minor": minor, "gitVersion": f"v{KUBERNETES_VERSION}", "gitCommit": "stand-in",
            "gitTreeState": "clean", "buildDate": "2024-12-11T00:00:00Z", "goVersion": "go1.23.4", "compiler": "gc",
            "platform": "linux/amd64"}


def api_versions(server_address: str) -> dict:
    return {"kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}]}


def api_group_list(installed: frozenset[str] = frozenset()) -> dict:
    groups = []
    for group_version in served_group_versions(installed):
        group, version_name = group_version.split("/")
        entry = {"groupVersion": group_version, "version": version_name}
        groups.append({"name": group, "versions": [entry], "preferredVersion": entry})
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}


def resource_list(group_version: str, installed: frozenset[str] = frozenset()) -> dict | None:
    """The APIResourceList of a group version; None if it is not served."""
    group = group_version.rpartition("/")[0] if "/" in group_version else ""
    if group_version not in served_group_versions(installed) + ["v1"]:
        return None
    resources = []
    for r in RESOURCE_LIST:
        if r.group_version != group_version:
            continue
        entry = {"name": r.plural, "singularName": r.singular, "namespaced": r.namespaced, "kind": r.kind, "verbs": list(r.verbs)}
        if r.short_names:
            entry["shortNames"] = list(r.short_names)
        if r.categories:
            entry["categories"] = list(r.categories)
        resources.append(entry)
        for (plural, sub), (kind, verbs) in SUBRESOURCES.items():
            if plural == r.plural:
                entry = {"name": f"{plural}/{sub}", "singularName": "", "namespaced": r.namespaced, "kind": kind, "verbs": list(verbs)}
                if kind.count("/") == 2:  # a subresource of another group's kind
                    entry["group"], entry["version"], entry["kind"] = kind.split("/")
                resources.append(entry)
    for plural in REVIEW_GROUPS.get(group, []):
        kind = {"selfsubjectaccessreviews": "SelfSubjectAccessReview", "selfsubjectrulesreviews": "SelfSubjectRulesReview",
                "selfsubjectreviews": "SelfSubjectReview"}[plural]
        resources.append({"name": plural, "singularName": kind.lower(), "namespaced": False, "kind": kind, "verbs": ["create"]})
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": resources}


def validate(obj: dict, strict: bool = False) -> None:
    """Against Kubernetes' schema: 422 Invalid; `strict` (`fieldValidation=Strict`, what kubectl's
    default `--validate=strict` sends) refuses unknown fields too, with the server's 400."""
    import kubernetes_validate

    kind, name = obj.get("kind"), obj.get("metadata", {}).get("name")
    try:
        kubernetes_validate.validate(obj, SCHEMA_VERSION, strict=strict)
    except kubernetes_validate.ValidationError as exc:
        first = str(exc).splitlines()[0]
        if strict and "Additional properties are not allowed" in first:
            raise ApiError(400, "BadRequest", f"strict decoding error: unknown field in {kind}: {first}") from None
        raise ApiError(422, "Invalid", f'{kind} "{name}" is invalid: {first}') from None


# -- OpenAPI ------------------------------------------------------------------------------------------
def schema_folder(release: str = KUBERNETES_VERSION) -> str:
    import kubernetes_validate

    return os.path.join(os.path.dirname(kubernetes_validate.__file__), "kubernetes-json-schema", f"v{release}-local")


@functools.lru_cache(maxsize=1)
def definitions() -> dict:
    """Kubernetes' schemas as OpenAPI has them: single types (the JSON-schema copy's `null` dropped),
    `$ref`s to `#/definitions/`, int-or-string and quantities as the `string` format they are."""
    with open(os.path.join(schema_folder(), "_definitions.json"), encoding="utf-8") as f:
        defs = json.load(f)["$defs"]

    def convert(node):
        if isinstance(node, list):
            return [convert(n) for n in node]
        if not isinstance(node, dict):
            return node
        if "oneOf" in node and all(set(o) == {"type"} for o in node["oneOf"]):  # IntOrString, Quantity
            node = {k: v for k, v in node.items() if k != "oneOf"}
            node.update(type="string", format="int-or-string")
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                out[key] = value.replace("#/$defs/", "#/definitions/")
            elif key == "type" and isinstance(value, list):
                out[key] = next(t for t in value if t != "null")
            elif key == "enum" and isinstance(value, list):
                out[key] = [v for v in value if v is not None]
            else:
                out[key] = convert(value)
        return out

    return {name: convert(schema) for name, schema in defs.items()}


def _gvk(r: Resource) -> dict:
    return {"group": r.group, "version": r.version, "kind": r.kind}


def _paths(r: Resource) -> dict[str, dict]:
    """The paths of one resource, with the operations kubectl's verifiers read."""
    prefix = f"/api/{r.version}" if not r.group else f"/apis/{r.group}/{r.version}"
    collection = f"{prefix}/namespaces/{{namespace}}/{r.plural}" if r.namespaced else f"{prefix}/{r.plural}"
    ref = {"$ref": f"#/definitions/{_definition_name(r)}"} if r.schema and _definition_name(r) else {"type": "object"}
    field_validation = {"name": "fieldValidation", "in": "query", "type": "string", "uniqueItems": True,
                        "description": "fieldValidation instructs the server on how to handle objects in the request "
                                       "containing unknown or duplicate fields."}

    def op(verb: str, body: bool = False) -> dict:
        operation = {"operationId": f"{verb}{r.kind}", "x-kubernetes-action": verb, "x-kubernetes-group-version-kind": _gvk(r),
                     "responses": {"200": {"description": "OK", "schema": ref}}}
        if body:
            operation["parameters"] = [field_validation]
        return operation

    return {collection: {"get": op("list"), "post": op("post", True)},
            f"{collection}/{{name}}": {"get": op("get"), "put": op("put", True), "patch": op("patch", True), "delete": op("delete")}}


@functools.lru_cache(maxsize=None)
def _definition_name(r: Resource) -> str | None:
    for name, schema in definitions().items():
        if _gvk(r) in (schema.get("x-kubernetes-group-version-kind") or []):
            return name
    return None


@functools.lru_cache(maxsize=1)
def openapi_v2() -> bytes:
    paths = {}
    for r in RESOURCE_LIST:
        if not r.optional:  # an installed CRD's schema is not published here
            paths.update(_paths(r))
    doc = {"swagger": "2.0", "info": {"title": "Kubernetes", "version": f"v{KUBERNETES_VERSION}"}, "paths": paths,
           "definitions": definitions(), "securityDefinitions": {"BearerToken": {"type": "apiKey", "name": "authorization",
                                                                                  "in": "header"}}}
    return json.dumps(doc).encode()


def _v3_refs(node):
    """Swagger 2.0 schema references as OpenAPI 3.0 has them: under `#/components/schemas/`."""
    if isinstance(node, list):
        return [_v3_refs(n) for n in node]
    if not isinstance(node, dict):
        return node
    return {k: v.replace("#/definitions/", "#/components/schemas/") if k == "$ref" and isinstance(v, str) else _v3_refs(v)
            for k, v in node.items()}


def _v3_operation(operation: dict) -> dict:
    """A Swagger 2.0 operation as OpenAPI 3.0 has it: a parameter's type in `schema`, a response's in `content`."""
    out = dict(operation)
    out["responses"] = {code: {"description": r["description"], "content": {"application/json": {"schema": _v3_refs(r["schema"])}}}
                        for code, r in operation["responses"].items()}
    if "parameters" in operation:
        out["parameters"] = [{**{k: v for k, v in p.items() if k not in ("type", "uniqueItems")}, "schema": {"type": p["type"]}}
                             for p in operation["parameters"]]
    return out


@functools.lru_cache(maxsize=None)
def openapi_v3(group_version: str) -> bytes | None:
    """The OpenAPI 3.0 document of `api/v1` or `apis/GROUP/VERSION`; None if not served."""
    served = [r for r in RESOURCE_LIST if not r.optional
              and ("api/" + r.version if not r.group else f"apis/{r.group_version}") == group_version]
    if not served:
        return None
    paths = {}
    for r in served:
        paths.update({path: {verb: _v3_operation(op) for verb, op in ops.items()} for path, ops in _paths(r).items()})
    doc = {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": f"v{KUBERNETES_VERSION}"}, "paths": paths,
           "components": {"schemas": _v3_refs(definitions()),
                          "securitySchemes": {"BearerToken": {"type": "apiKey", "name": "authorization", "in": "header"}}}}
    return json.dumps(doc).encode()


def openapi_v3_index() -> dict:
    paths = {}
    for gv in dict.fromkeys("api/v1" if not r.group else f"apis/{r.group_version}" for r in RESOURCE_LIST if not r.optional):
        digest = hashlib.sha512(openapi_v3(gv)).hexdigest()[:128].upper()
        paths[gv] = {"serverRelativeURL": f"/openapi/v3/{gv}?hash={digest}"}
    return {"paths": paths}


def serve(path: str, accept: str, server_address: str,
          installed: frozenset[str] = frozenset()) -> tuple[int, dict | bytes] | None:
    """The answer to a discovery or OpenAPI path (None: not one of them)."""
    path = "/" + path.strip("/")
    if path == "/version":
        return 200, version()
    if path == "/api":
        return 200, api_versions(server_address)
    if path == "/apis":
        return 200, api_group_list(installed)
    if path == "/api/v1" or (path.startswith("/apis/") and path.count("/") == 3):
        found = resource_list(path.split("/", 2)[2], installed)
        return (200, found) if found else None
    if path == "/openapi/v2":
        if accept and "json" not in accept and "*/*" not in accept:
            return 406, b"only application/json is served"
        return 200, openapi_v2()
    if path == "/openapi/v3":
        return 200, openapi_v3_index()
    if path.startswith("/openapi/v3/"):
        found = openapi_v3(path[len("/openapi/v3/"):])
        return (200, found) if found else (404, b"not found")
    return None
