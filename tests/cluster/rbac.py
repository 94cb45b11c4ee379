"""Authentication and authorization as the API server does them, for the rules we ship.

A request's bearer token names a user: a ServiceAccount (`system:serviceaccount:NS:NAME`) or one
of the cluster's own identities (the admin, the kubelet). A ServiceAccount may do only what the
Roles bound to it in a namespace grant, in that namespace only; the RBAC objects are read from
the repository's `deploy/rbac/` (as `kubectl apply -k deploy/` would create them), never copied.

Not modelled: aggregated ClusterRoles, groups other than the superuser's, impersonation,
non-resource URLs, the Node authorizer (the kubelet gets a ClusterRole of what it calls).
"""

from __future__ import annotations

import os
import secrets
import threading
from dataclasses import dataclass, field

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY_RBAC = os.path.join(REPO, "deploy", "rbac")
SUPERUSER = "system:admin"  # in group system:masters: allowed everything, as the API server does


@dataclass(frozen=True)
class Request:
    """What the authorizer looks at: the API server's RequestInfo."""

    verb: str  # get list watch create update patch delete deletecollection
    api_group: str  # "" for the core group
    resource: str  # "pods", or "pods/log" with its subresource
    namespace: str  # "" for a cluster-wide request
    name: str = ""


@dataclass
class Rule:
    api_groups: list[str]
    resources: list[str]
    verbs: list[str]
    resource_names: list[str] = field(default_factory=list)

    def allows(self, req: Request) -> bool:
        return (
            ("*" in self.api_groups or req.api_group in self.api_groups)
            and ("*" in self.resources or req.resource in self.resources)
            and ("*" in self.verbs or req.verb in self.verbs)
            and (not self.resource_names or req.name in self.resource_names)
        )

    @classmethod
    def from_manifest(cls, rule: dict) -> "Rule":
        return cls(list(rule.get("apiGroups") or []), list(rule.get("resources") or []),
                   list(rule.get("verbs") or []), list(rule.get("resourceNames") or []))


def service_account_user(namespace: str, name: str) -> str:
    return f"system:serviceaccount:{namespace}:{name}"


def read_manifests(folder: str = DEPLOY_RBAC) -> list[dict]:
    """Every object of a kustomization folder's resources, in order."""
    with open(os.path.join(folder, "kustomization.yaml"), encoding="utf-8") as f:
        kustomization = yaml.safe_load(f)
    objects = []
    for name in kustomization.get("resources", []):
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            objects.extend(o for o in yaml.safe_load_all(f) if o)
    return objects


def kustomize_namespace(objects: list[dict], namespace: str) -> list[dict]:
    """What kustomize's `namespace:` does to RBAC objects: every namespaced object, and each
    ServiceAccount subject of a binding, moves to `namespace`."""
    out = []
    for obj in objects:
        obj = yaml.safe_load(yaml.safe_dump(obj))
        if obj["kind"] not in ("ClusterRole", "ClusterRoleBinding", "Namespace"):
            obj["metadata"]["namespace"] = namespace
        for subject in obj.get("subjects") or []:
            if subject.get("kind") == "ServiceAccount":
                subject["namespace"] = namespace
        out.append(obj)
    return out


class Authorizer:
    """Tokens -> users, and users -> what RBAC allows them. Thread-safe."""

    def __init__(self):
        self.lock = threading.Lock()
        self.tokens: dict[str, str] = {}
        self.roles: dict[tuple[str, str], list[Rule]] = {}  # (namespace, name) -> rules; namespace "" = ClusterRole
        self.bindings: list[tuple[str, str, str, list[str]]] = []  # (namespace or "", role kind, role name, users)

    def issue_token(self, user: str) -> str:
        token = secrets.token_urlsafe(24)
        with self.lock:
            self.tokens[token] = user
        return token

    def user_of(self, authorization: str | None) -> str | None:
        if not authorization or not authorization.lower().startswith("bearer "):
            return None
        with self.lock:
            return self.tokens.get(authorization[len("bearer "):].strip())

    def add_role(self, namespace: str, name: str, rules: list[dict]) -> None:
        with self.lock:
            self.roles[(namespace, name)] = [Rule.from_manifest(r) for r in rules]

    def add_binding(self, namespace: str, role_ref: dict, subjects: list[dict]) -> None:
        users = []
        for s in subjects or []:
            if s.get("kind") == "ServiceAccount":
                users.append(service_account_user(s.get("namespace") or namespace, s["name"]))
            elif s.get("kind") == "User":
                users.append(s["name"])
        with self.lock:
            self.bindings.append((namespace, role_ref["kind"], role_ref["name"], users))

    def apply(self, obj: dict) -> None:
        """Take in a Role, ClusterRole, RoleBinding or ClusterRoleBinding manifest."""
        kind, meta = obj["kind"], obj["metadata"]
        if kind == "Role":
            self.add_role(meta["namespace"], meta["name"], obj.get("rules") or [])
        elif kind == "ClusterRole":
            self.add_role("", meta["name"], obj.get("rules") or [])
        elif kind == "RoleBinding":
            self.add_binding(meta["namespace"], obj["roleRef"], obj.get("subjects") or [])
        elif kind == "ClusterRoleBinding":
            self.add_binding("", obj["roleRef"], obj.get("subjects") or [])

    def allowed(self, user: str, req: Request) -> bool:
        if user == SUPERUSER:
            return True
        with self.lock:
            for namespace, kind, role, users in self.bindings:
                if user not in users:
                    continue
                # A RoleBinding grants only in its own namespace, even when it points at a ClusterRole.
                if namespace and namespace != req.namespace:
                    continue
                rules = self.roles.get(("" if kind == "ClusterRole" else namespace, role), [])
                if any(rule.allows(req) for rule in rules):
                    return True
        return False


def forbidden_message(user: str, req: Request) -> str:
    """The API server's own wording."""
    resource, _, sub = req.resource.partition("/")
    what = f'{resource}{"/" + sub if sub else ""}'
    subject = f'{what} "{req.name}"' if req.name else what
    where = f'in the namespace "{req.namespace}"' if req.namespace else "at the cluster scope"
    return (f'{subject} is forbidden: User "{user}" cannot {req.verb} resource "{resource}"'
            f'{" (subresource " + repr(sub) + ")" if sub else ""} in API group "{req.api_group}" {where}')
