"""Authentication and authorization as the API server does them, for the rules we ship.

A request's bearer token names a user: a ServiceAccount (`system:serviceaccount:NS:NAME`) or one
of the cluster's own identities (the admin, the kubelet). A ServiceAccount may do only what the
Roles bound to it in a namespace grant, in that namespace only; the RBAC objects are read from
the repository's `deploy/rbac/` (as `kubectl apply -k deploy/` would create them), never copied.

Also as the API server does: a user's groups (`system:authenticated`; a ServiceAccount's
`system:serviceaccounts` and `system:serviceaccounts:NS`) match Group subjects; the bootstrap
ClusterRole `system:basic-user` lets every authenticated user ask what it may do; a ClusterRole
with an `aggregationRule` holds the rules of every ClusterRole its selectors match, as the
clusterrole-aggregation controller fills it in (kubeflow's `kubeflow-edit` is one); and
`authorization.k8s.io/v1` SelfSubjectAccessReview and SelfSubjectRulesReview and
`authentication.k8s.io/v1` SelfSubjectReview are answered from this same evaluation (`review`;
kubernetes pkg/registry/authorization/selfsubjectaccessreview, selfsubjectrulesreview).

Not modelled: impersonation, non-resource URLs, the Node authorizer (the kubelet gets a
ClusterRole of what it calls), deny decisions (RBAC only allows).
"""

from __future__ import annotations

import os
import secrets
import threading
from dataclasses import dataclass, field

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY_RBAC = os.path.join(REPO, "deploy", "rbac")
PLATFORM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "platform")
SUPERUSER = "system:admin"  # in group system:masters: allowed everything, as the API server does
AUTHENTICATED = "system:authenticated"
GROUP_PREFIX = "group:"  # how a Group subject is kept among a binding's users
BASIC_USER = "system:basic-user"
BASIC_USER_RULES = [  # kubernetes' bootstrap ClusterRole of that name (plugin/pkg/auth/authorizer/rbac/bootstrappolicy)
    {"apiGroups": ["authorization.k8s.io"], "resources": ["selfsubjectaccessreviews", "selfsubjectrulesreviews"],
     "verbs": ["create"]},
    {"apiGroups": ["authentication.k8s.io"], "resources": ["selfsubjectreviews"], "verbs": ["create"]},
]


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


def groups_of(user: str) -> list[str]:
    """The groups the authenticator puts an authenticated user in."""
    parts = user.split(":")
    if len(parts) == 4 and parts[:2] == ["system", "serviceaccount"]:
        return ["system:serviceaccounts", f"system:serviceaccounts:{parts[2]}", AUTHENTICATED]
    return [AUTHENTICATED]


def read_platform(name: str) -> list[dict]:
    """KFP's or Kubeflow's own RBAC as their manifests define it (platform/NAME.yaml, sources
    named in each): `kfp-single-user` (pipeline-runner, the executor plugin's Role) or
    `kubeflow-multi-user` (a profile's default-editor and the kubeflow-edit aggregate)."""
    with open(os.path.join(PLATFORM, f"{name}.yaml"), encoding="utf-8") as f:
        return [o for o in yaml.safe_load_all(f) if o]


def read_manifests(folder: str = DEPLOY_RBAC) -> list[dict]:
    """Every object of a kustomization folder's resources, in order (a resource that is a folder:
    its own kustomization's, as kustomize includes it)."""
    with open(os.path.join(folder, "kustomization.yaml"), encoding="utf-8") as f:
        kustomization = yaml.safe_load(f)
    objects = []
    for name in kustomization.get("resources", []):
        path = os.path.join(folder, name)
        if os.path.isdir(path):
            objects.extend(read_manifests(path))
            continue
        with open(path, encoding="utf-8") as f:
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


class BoundUser(str):
    """A user name that also carries its token's extra (kubernetes pkg/serviceaccount: a token bound
    to a pod authenticates with `authentication.kubernetes.io/pod-name` and `pod-uid`)."""

    def __new__(cls, name: str, extra: dict[str, list[str]]):
        user = super().__new__(cls, name)
        user.extra = {k: list(v) for k, v in extra.items()}
        return user


def pod_bound_extra(pod_name: str, pod_uid: str) -> dict[str, list[str]]:
    return {"authentication.kubernetes.io/pod-name": [pod_name], "authentication.kubernetes.io/pod-uid": [pod_uid]}


class Authorizer:
    """Tokens -> users, and users -> what RBAC allows them. Thread-safe."""

    def __init__(self):
        self.lock = threading.Lock()
        self.tokens: dict[str, str] = {}
        self.roles: dict[tuple[str, str], list[Rule]] = {}  # (namespace, name) -> rules; namespace "" = ClusterRole
        self.bindings: list[tuple[str, str, str, list[str]]] = []  # (namespace or "", role kind, role name, users)
        self.cluster_role_labels: dict[str, dict] = {}
        self.named_bindings: dict[tuple[str, str, str], tuple] = {}  # (kind, namespace, name) -> its entry in bindings
        self.aggregations: dict[str, list[dict]] = {}  # ClusterRole -> its aggregationRule's matchLabels
        # The API server's bootstrap policy: every authenticated user may ask what it may do.
        self.add_role("", BASIC_USER, BASIC_USER_RULES)
        self.add_binding("", {"kind": "ClusterRole", "name": BASIC_USER}, [{"kind": "Group", "name": AUTHENTICATED}])

    def issue_token(self, user: str, extra: dict[str, list[str]] | None = None) -> str:
        """`extra`: the user's extra of a token bound to a pod (TokenRequest's boundObjectRef),
        which admission policies see as request.userInfo.extra."""
        token = secrets.token_urlsafe(24)
        with self.lock:
            self.tokens[token] = BoundUser(user, extra) if extra else user
        return token

    def user_of(self, authorization: str | None) -> str | None:
        if not authorization or not authorization.lower().startswith("bearer "):
            return None
        with self.lock:
            return self.tokens.get(authorization[len("bearer "):].strip())

    def add_role(self, namespace: str, name: str, rules: list[dict], labels: dict | None = None,
                 aggregation: list[dict] | None = None) -> None:
        """`labels` and `aggregation` (an aggregationRule's clusterRoleSelectors): ClusterRoles only."""
        with self.lock:
            self.roles[(namespace, name)] = [Rule.from_manifest(r) for r in rules]
            if not namespace:
                self.cluster_role_labels[name] = dict(labels or {})
                if aggregation:
                    self.aggregations[name] = [s.get("matchLabels") or {} for s in aggregation]

    def add_binding(self, namespace: str, role_ref: dict, subjects: list[dict], name: str = "", kind: str = "") -> None:
        """`name` and `kind` (RoleBinding, ClusterRoleBinding): a binding object, which replaces
        the one of that name (an update through the API); without them, a grant of the cluster's own."""
        users = []
        for s in subjects or []:
            if s.get("kind") == "ServiceAccount":
                users.append(service_account_user(s.get("namespace") or namespace, s["name"]))
            elif s.get("kind") == "User":
                users.append(s["name"])
            elif s.get("kind") == "Group":
                users.append(GROUP_PREFIX + s["name"])
        entry = (namespace, role_ref["kind"], role_ref["name"], users)
        with self.lock:
            if name:
                self._forget_binding((kind, namespace, name))
                self.named_bindings[(kind, namespace, name)] = entry
            self.bindings.append(entry)

    def _forget_binding(self, key: tuple[str, str, str]) -> None:
        old = self.named_bindings.pop(key, None)
        self.bindings = [b for b in self.bindings if b is not old]

    def remove(self, obj: dict) -> None:
        """A Role, ClusterRole or binding deleted through the API: what it granted is gone."""
        kind, meta = obj["kind"], obj["metadata"]
        with self.lock:
            if kind in ("Role", "ClusterRole"):
                name = meta["name"]
                self.roles.pop((meta.get("namespace", "") if kind == "Role" else "", name), None)
                if kind == "ClusterRole":
                    self.cluster_role_labels.pop(name, None)
                    self.aggregations.pop(name, None)
            else:
                self._forget_binding((kind, meta.get("namespace", "") if kind == "RoleBinding" else "", meta["name"]))

    def apply(self, obj: dict) -> None:
        """Take in a Role, ClusterRole, RoleBinding or ClusterRoleBinding manifest."""
        kind, meta = obj["kind"], obj["metadata"]
        if kind == "Role":
            self.add_role(meta["namespace"], meta["name"], obj.get("rules") or [])
        elif kind == "ClusterRole":
            self.add_role("", meta["name"], obj.get("rules") or [], meta.get("labels"),
                          (obj.get("aggregationRule") or {}).get("clusterRoleSelectors"))
        elif kind == "RoleBinding":
            self.add_binding(meta["namespace"], obj["roleRef"], obj.get("subjects") or [], meta["name"], kind)
        elif kind == "ClusterRoleBinding":
            self.add_binding("", obj["roleRef"], obj.get("subjects") or [], meta["name"], kind)

    def allowed(self, user: str, req: Request) -> bool:
        if user == SUPERUSER:
            return True
        return any(rule.allows(req) for rule in self.rules_for(user, req.namespace))

    def rules_for(self, user: str, namespace: str) -> list[Rule]:
        """Every rule granted to `user` in `namespace` ("": cluster-wide only), as RBAC's rule
        resolver lists them: ClusterRoleBindings' everywhere, RoleBindings' in their namespace."""
        subjects = {user, *(GROUP_PREFIX + g for g in groups_of(user))}
        with self.lock:
            found = []
            for bound_in, kind, role, users in self.bindings:
                # A RoleBinding grants only in its own namespace, even when it points at a ClusterRole.
                if subjects.isdisjoint(users) or (bound_in and bound_in != namespace):
                    continue
                found += self._role_rules("" if kind == "ClusterRole" else bound_in, role, set())
            return found

    def _role_rules(self, namespace: str, name: str, seen: set[str]) -> list[Rule]:
        """A role's rules; an aggregated ClusterRole's are those of every ClusterRole it selects."""
        if namespace or name not in self.aggregations:
            return list(self.roles.get((namespace, name), []))
        seen.add(name)
        rules = []
        for other, labels in self.cluster_role_labels.items():
            if other not in seen and any(selector.items() <= labels.items() for selector in self.aggregations[name]):
                rules += self._role_rules("", other, seen)
        return rules


def forbidden_message(user: str, req: Request) -> str:
    """The API server's own wording."""
    resource, _, sub = req.resource.partition("/")
    what = f'{resource}{"/" + sub if sub else ""}'
    subject = f'{what} "{req.name}"' if req.name else what
    where = f'in the namespace "{req.namespace}"' if req.namespace else "at the cluster scope"
    return (f'{subject} is forbidden: User "{user}" cannot {req.verb} resource "{resource}"'
            f'{" (subresource " + repr(sub) + ")" if sub else ""} in API group "{req.api_group}" {where}')


# -- the reviews a user asks about itself -----------------------------------------------------------
# (group, plural) -> kind: cluster-scoped, `create` only, answered from the RBAC evaluation above.
REVIEWS = {
    ("authorization.k8s.io", "selfsubjectaccessreviews"): "SelfSubjectAccessReview",
    ("authorization.k8s.io", "selfsubjectrulesreviews"): "SelfSubjectRulesReview",
    ("authentication.k8s.io", "selfsubjectreviews"): "SelfSubjectReview",
    # namespaced, about another user (spec.user): what a namespace's admins may ask (`elastic-step submit` does)
    ("authorization.k8s.io", "localsubjectaccessreviews"): "LocalSubjectAccessReview",
}


def review(authorizer: Authorizer, user: str, api_group: str, plural: str, body: dict) -> dict:
    """The answer to a review the caller (`user`) created: the body sent, with `status` filled in,
    as kube-apiserver's registry for it does. Raises ApiError as it does for a malformed one."""
    from .objects import ApiError

    kind = REVIEWS[(api_group, plural)]
    spec = body.get("spec") or {}
    answer = {"kind": kind, "apiVersion": f"{api_group}/v1", "metadata": {"creationTimestamp": None}}
    if kind == "SelfSubjectReview":
        return {**answer, "status": {"userInfo": {"username": user, "groups": groups_of(user)}}}
    if kind == "SelfSubjectRulesReview":
        if not spec.get("namespace"):
            raise ApiError(400, "BadRequest", "no namespace on request")
        rules = [{"verbs": r.verbs, "apiGroups": r.api_groups, "resources": r.resources,
                  **({"resourceNames": r.resource_names} if r.resource_names else {})}
                 for r in authorizer.rules_for(user, spec["namespace"])]
        if user == SUPERUSER:
            rules = [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"]}]
        return {**answer, "spec": spec, "status": {"resourceRules": rules, "nonResourceRules": [], "incomplete": False}}
    if kind == "LocalSubjectAccessReview":  # answered for spec.user and spec.groups, not for the caller
        user = spec.get("user") or ""
    attributes = spec.get("resourceAttributes")
    if (attributes is None) == (spec.get("nonResourceAttributes") is None):
        raise ApiError(422, "Invalid", f'{kind}.authorization.k8s.io "" is invalid: spec.resourceAttributes: Invalid '
                                       "value: exactly one of nonResourceAttributes or resourceAttributes must be specified")
    if attributes is None:  # non-resource URLs are not modelled: only the superuser reaches them
        return {**answer, "spec": spec, "status": {"allowed": user == SUPERUSER}}
    resource = attributes.get("resource") or ""
    if attributes.get("subresource"):
        resource += "/" + attributes["subresource"]
    req = Request(attributes.get("verb") or "", attributes.get("group") or "", resource,
                  attributes.get("namespace") or "", attributes.get("name") or "")
    return {**answer, "spec": spec, "status": {"allowed": authorizer.allowed(user, req)}}
