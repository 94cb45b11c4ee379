"""The API server's admission, in kube-apiserver's order and words: of a pod, defaults and the
ServiceAccount plugin, PodSecurity, ResourceQuota; of every write, ValidatingAdmissionPolicies
(below, with CEL evaluated by cel-python). Each refusal is the server's Status.

- ServiceAccount (plugin/pkg/admission/serviceaccount): the pod's account must exist; its token is
  mounted (the projected `kube-api-access-*` volume) unless automounting is off.
- PodSecurity (staging/src/k8s.io/pod-security-admission/policy): a namespace labelled
  `pod-security.kubernetes.io/enforce: baseline|restricted` refuses a pod that breaks a check of
  that level, every failed check named in the check's own words (`violates PodSecurity
  "restricted:latest": allowPrivilegeEscalation != false (container "main" must set ...)`), in
  the checks' order; `privileged` (or no label) admits everything. Checks: baseline's
  privileged, host namespaces, hostPath volumes, hostPorts, added capabilities, seccomp
  `Unconfined`; restricted's volume types, allowPrivilegeEscalation, runAsNonRoot, runAsUser=0,
  capabilities (drop ALL, add at most NET_BIND_SERVICE) and seccomp RuntimeDefault/Localhost.
  Not modelled: `warn`/`audit` modes, `enforce-version`, exemptions, AppArmor, SELinux, sysctls,
  procMount.
- ResourceQuota (pkg/quota/v1/evaluator/core/pods.go): when a quota of the namespace limits cpu or
  memory (requests or limits), every container must state that resource (`failed quota: Q: must
  specify requests.cpu for: main`), and the pods that have not finished may not together ask for
  more than the quota's `hard` (`exceeded quota: Q, requested: ..., used: ..., limited: ...`).
"""

from __future__ import annotations

import uuid
from decimal import Decimal

import celpy
from celpy import celtypes
from kubernetes.utils.quantity import parse_quantity

from .objects import ApiError

ENFORCE = "pod-security.kubernetes.io/enforce"
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
                         "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
QUOTA_VALIDATED = ("limits.cpu", "limits.memory", "requests.cpu", "requests.memory")


def admit_pod(store, namespace: str, pod: dict) -> None:
    """Default, then admit `pod` into `namespace` (ApiError 403 if refused); `store`'s lock is held."""
    spec = pod.setdefault("spec", {})
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("schedulerName", "default-scheduler")
    for container in spec.get("containers") or []:  # a request left out is the limit (the defaulting of resources)
        resources = container.get("resources") or {}
        for name, value in (resources.get("limits") or {}).items():
            resources.setdefault("requests", {}).setdefault(name, value)
    _service_account(store, namespace, pod)
    ns = store.objects.get(("namespaces", "", namespace)) or {}
    level = (ns.get("metadata", {}).get("labels") or {}).get(ENFORCE, "privileged")
    if level in ("baseline", "restricted"):
        failures = pod_security_failures(spec, level)
        if failures:
            raise ApiError(403, "Forbidden", f'pods "{pod["metadata"]["name"]}" is forbidden: violates PodSecurity '
                                             f'"{level}:latest": {", ".join(failures)}')
    for quota in sorted((o for (p, n, _), o in store.objects.items() if p == "resourcequotas" and n == namespace),
                        key=lambda q: q["metadata"]["name"]):
        _check_quota(store, namespace, pod, quota)
    pod["status"] = {"phase": "Pending", "qosClass": "Burstable"}


def _service_account(store, namespace: str, pod: dict) -> None:
    spec = pod["spec"]
    account = spec.get("serviceAccountName") or "default"
    spec["serviceAccountName"] = account
    sa = store.objects.get(("serviceaccounts", namespace, account))
    if sa is None:
        raise ApiError(403, "Forbidden", f'pods "{pod["metadata"]["name"]}" is forbidden: error looking up service '
                                         f'account {namespace}/{account}: serviceaccount "{account}" not found')
    automount = spec.get("automountServiceAccountToken")
    if automount is None:
        automount = sa.get("automountServiceAccountToken", True)
    if automount:
        volume = f"kube-api-access-{uuid.uuid4().hex[:5]}"
        spec.setdefault("volumes", []).append({"name": volume, "projected": {"defaultMode": 0o644, "sources": [
            {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
            {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
            {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}},
        ]}})
        for container in spec.get("containers", []):
            container.setdefault("volumeMounts", []).append(
                {"name": volume, "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": True})


# -- PodSecurity ----------------------------------------------------------------------------------------
def _named(names: list[str], singular: str = "container") -> str:
    """pluralize + joinQuote: `container "a"`, `containers "a", "b"`."""
    return f'{singular if len(names) == 1 else singular + "s"} {", ".join(chr(34) + n + chr(34) for n in names)}'


def _containers(spec: dict) -> list[dict]:
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or []) + list(spec.get("ephemeralContainers") or [])


def _security(container: dict) -> dict:
    return container.get("securityContext") or {}


def pod_security_failures(spec: dict, level: str) -> list[str]:
    """`reason (detail)` of every check of `level` the pod spec fails, in the policy's check order; a
    restricted check overrides its baseline counterpart (capabilities, seccomp, hostPath volumes)."""
    restricted = level == "restricted"
    checks = [_allow_privilege_escalation if restricted else None, None if restricted else _baseline_capabilities,
              _restricted_capabilities if restricted else None, _host_namespaces, None if restricted else _host_path_volumes,
              _host_ports, _privileged,
              _restricted_volumes if restricted else None, _run_as_non_root if restricted else None,
              _run_as_user if restricted else None, None if restricted else _baseline_seccomp,
              _restricted_seccomp if restricted else None]
    return [failure for check in checks if check for failure in [check(spec)] if failure]


def _allow_privilege_escalation(spec: dict) -> str:
    bad = [c["name"] for c in _containers(spec) if _security(c).get("allowPrivilegeEscalation") is not False]
    return f"allowPrivilegeEscalation != false ({_named(bad)} must set securityContext.allowPrivilegeEscalation=false)" if bad else ""


def _baseline_capabilities(spec: dict) -> str:
    added = {c["name"]: [a for a in (_security(c).get("capabilities") or {}).get("add") or [] if a not in BASELINE_CAPABILITIES]
             for c in _containers(spec)}
    bad = [n for n, a in added.items() if a]
    caps = sorted({a for n in bad for a in added[n]})
    return (f"non-default capabilities ({_named(bad)} must not include {', '.join(chr(34) + c + chr(34) for c in caps)} "
            "in securityContext.capabilities.add)") if bad else ""


def _restricted_capabilities(spec: dict) -> str:
    no_drop, adding, caps = [], [], set()
    for c in _containers(spec):
        capabilities = _security(c).get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            no_drop.append(c["name"])
        extra = [a for a in capabilities.get("add") or [] if a != "NET_BIND_SERVICE"]
        if extra:
            adding.append(c["name"])
            caps |= set(extra)
    details = []
    if no_drop:
        details.append(f'{_named(no_drop)} must set securityContext.capabilities.drop=["ALL"]')
    if adding:
        details.append(f"{_named(adding)} must not include {', '.join(chr(34) + c + chr(34) for c in sorted(caps))} "
                       "in securityContext.capabilities.add")
    return f"unrestricted capabilities ({'; '.join(details)})" if details else ""


def _host_namespaces(spec: dict) -> str:
    bad = [f"{k}=true" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    return f"host namespaces ({', '.join(bad)})" if bad else ""


def _host_path_volumes(spec: dict) -> str:
    bad = [v["name"] for v in spec.get("volumes") or [] if "hostPath" in v]
    return f"hostPath volumes ({_named(bad, 'volume')})" if bad else ""


def _host_ports(spec: dict) -> str:
    ports = {c["name"]: [str(p["hostPort"]) for p in c.get("ports") or [] if p.get("hostPort")] for c in _containers(spec)}
    bad = [n for n, p in ports.items() if p]
    return f"hostPort ({_named(bad)} {'uses' if len(bad) == 1 else 'use'} hostPorts {', '.join(p for n in bad for p in ports[n])})" if bad else ""


def _privileged(spec: dict) -> str:
    bad = [c["name"] for c in _containers(spec) if _security(c).get("privileged")]
    return f"privileged ({_named(bad)} must not set securityContext.privileged=true)" if bad else ""


def _restricted_volumes(spec: dict) -> str:
    bad = sorted(v["name"] for v in spec.get("volumes") or [] if not RESTRICTED_VOLUMES & set(v))
    return f"restricted volume types (volumes {bad!r} have restricted types)".replace("'", '"') if bad else ""


def _run_as_non_root(spec: dict) -> str:
    pod_value = (spec.get("securityContext") or {}).get("runAsNonRoot")
    explicit = [c["name"] for c in _containers(spec) if _security(c).get("runAsNonRoot") is False]
    implicit = [c["name"] for c in _containers(spec) if _security(c).get("runAsNonRoot") is None and pod_value is not True]
    setters = (["pod"] if pod_value is False else []) + ([_named(explicit)] if explicit else [])
    if setters:
        return f"runAsNonRoot != true ({' and '.join(setters)} must not set securityContext.runAsNonRoot=false)"
    return f"runAsNonRoot != true (pod or {_named(implicit)} must set securityContext.runAsNonRoot=true)" if implicit else ""


def _run_as_user(spec: dict) -> str:
    setters = (["pod"] if (spec.get("securityContext") or {}).get("runAsUser") == 0 else [])
    bad = [c["name"] for c in _containers(spec) if _security(c).get("runAsUser") == 0]
    setters += [_named(bad)] if bad else []
    return f"runAsUser=0 ({' and '.join(setters)} must not set runAsUser=0)" if setters else ""


def _seccomp_type(context: dict) -> str | None:
    return (context.get("seccompProfile") or {}).get("type")


def _baseline_seccomp(spec: dict) -> str:
    setters = ["pod"] if _seccomp_type(spec.get("securityContext") or {}) == "Unconfined" else []
    bad = [c["name"] for c in _containers(spec) if _seccomp_type(_security(c)) == "Unconfined"]
    setters += [_named(bad)] if bad else []
    return f'seccompProfile ({" and ".join(setters)} must not set securityContext.seccompProfile.type to "Unconfined")' if setters else ""


def _restricted_seccomp(spec: dict) -> str:
    allowed = ("RuntimeDefault", "Localhost")
    pod_type = _seccomp_type(spec.get("securityContext") or {})
    setters = ["pod"] if pod_type is not None and pod_type not in allowed else []
    bad = [c["name"] for c in _containers(spec) if _seccomp_type(_security(c)) not in (None, *allowed)]
    setters += [_named(bad)] if bad else []
    if setters:
        return f'seccompProfile ({" and ".join(setters)} must not set securityContext.seccompProfile.type to an unrestricted value)'
    unset = [c["name"] for c in _containers(spec) if _seccomp_type(_security(c)) is None] if pod_type is None else []
    return (f'seccompProfile (pod or {_named(unset)} must set securityContext.seccompProfile.type to "RuntimeDefault" '
            'or "Localhost")') if unset else ""


# -- ResourceQuota ----------------------------------------------------------------------------------------
def _quota_name(resource: str) -> str:
    return {"cpu": "requests.cpu", "memory": "requests.memory"}.get(resource, resource)


def pod_usage(pod: dict) -> dict[str, Decimal]:
    """What a pod counts against a quota: its containers' requests and limits, and one pod."""
    usage = {"pods": Decimal(1)}
    for container in (pod.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        for kind in ("requests", "limits"):
            for name, value in (resources.get(kind) or {}).items():
                key = f"{kind}.{name}"
                usage[key] = usage.get(key, Decimal(0)) + Decimal(parse_quantity(value))
    return usage


def _check_quota(store, namespace: str, pod: dict, quota: dict) -> None:
    name, hard = pod["metadata"]["name"], {_quota_name(k): v for k, v in ((quota.get("spec") or {}).get("hard") or {}).items()}
    missing: dict[str, list[str]] = {}
    for container in (pod["spec"].get("initContainers") or []) + (pod["spec"].get("containers") or []):
        resources = container.get("resources") or {}
        for resource in QUOTA_VALIDATED:
            kind, _, what = resource.partition(".")
            if resource in hard and what not in (resources.get(kind) or {}):
                missing.setdefault(resource, []).append(container["name"])
    if missing:
        detail = "; ".join(f"{r} for: {','.join(sorted(missing[r]))}" for r in sorted(missing))
        raise ApiError(403, "Forbidden", f'pods "{name}" is forbidden: failed quota: {quota["metadata"]["name"]}: must specify {detail}')
    used: dict[str, Decimal] = {}
    for (plural, ns, _), other in store.objects.items():
        if plural == "pods" and ns == namespace and (other.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            for key, value in pod_usage(other).items():
                used[key] = used.get(key, Decimal(0)) + value
    asked = pod_usage(pod)
    over = sorted(k for k in hard if k in asked and used.get(k, Decimal(0)) + asked[k] > Decimal(parse_quantity(hard[k])))
    if over:
        def listing(values): return ",".join(f"{k}={_text(values.get(k, Decimal(0)))}" for k in over)
        raise ApiError(403, "Forbidden", f'pods "{name}" is forbidden: exceeded quota: {quota["metadata"]["name"]}, '
                                         f"requested: {listing(asked)}, used: {listing(used)}, "
                                         f"limited: {','.join(f'{k}={hard[k]}' for k in over)}")


def _text(value: Decimal) -> str:
    """A quantity as the server prints it back: whole numbers plain, fractions of a core in millicores."""
    return str(int(value)) if value == value.to_integral_value() else f"{int(value * 1000)}m"


# -- ValidatingAdmissionPolicy ----------------------------------------------------------------------------
# staging/src/k8s.io/apiserver/pkg/admission/plugin/policy/validating (dispatcher.go, validator.go), as
# tests/test_admission_policy.py holds it to:
# - a policy applies to a request its matchConstraints match (resourceRules less excludeResourceRules:
#   group, version, operation, resource; namespaceSelector and objectSelector by matchLabels), then
#   each binding naming it whose matchResources match too; its matchConditions must all be true;
# - `variables` are evaluated in order, each seeing the ones before it, as `variables.NAME`; each
#   validation sees object, oldObject (null where there is none: CREATE's old, DELETE's new),
#   request, namespaceObject and variables;
# - a validation that is not true denies with its messageExpression's string (trimmed, one line),
#   else its message, else `failed expression: EXPR`, and its reason (default Invalid: 422;
#   Forbidden: 403); an evaluation error denies with the error unless failurePolicy is Ignore;
# - the first denial, in policy-name order, is the answer:
#   `RESOURCE "NAME" is forbidden: ValidatingAdmissionPolicy 'P' with binding 'B' denied request: MESSAGE`.
# Only bindings with validationActions Deny act (Warn and Audit are not modelled), nor are
# parameters (paramKind), the CEL cost budget, type checking, the authorizer variable, Kubernetes'
# CEL extension libraries (but the strings library's `substring`) or selectors' matchExpressions.
# A token bound to a pod (the kubelet's) gives request.userInfo.extra its pod-name and pod-uid. Requests of the server's own controllers (no user) are not judged.
POLICIES, BINDINGS = "validatingadmissionpolicies", "validatingadmissionpolicybindings"
REASON_CODES = {"Forbidden": 403, "Unauthorized": 401, "RequestEntityTooLarge": 413, "Invalid": 422}


class _Refused(Exception):
    """A denial: its message and reason."""

    def __init__(self, message: str, reason: str = "Invalid"):
        super().__init__(message)
        self.message, self.reason = message, reason


def admit_by_policies(store, user: str | None, operation: str, group: str, plural: str, namespace: str,
                      obj: dict | None, old: dict | None) -> None:
    """Judge a CREATE, UPDATE or DELETE of `user` by every ValidatingAdmissionPolicy stored (ApiError
    if one denies it); `store`'s lock is held."""
    policies = sorted((o for (p, _, _), o in store.objects.items() if p == POLICIES), key=lambda o: o["metadata"]["name"])
    if user is None or not policies:
        return
    target = obj if obj is not None else old
    request = _request(user, operation, group, plural, namespace, target)
    ns_object = store.objects.get(("namespaces", "", namespace)) if namespace else None
    for policy in policies:
        if not _matches(policy["spec"].get("matchConstraints") or {}, request, target, ns_object):
            continue
        bindings = sorted((o for (p, _, _), o in store.objects.items()
                           if p == BINDINGS and o["spec"].get("policyName") == policy["metadata"]["name"]),
                          key=lambda o: o["metadata"]["name"])
        for binding in bindings:
            if "Deny" not in binding["spec"].get("validationActions", []) or not _matches(
                    binding["spec"].get("matchResources") or {}, request, target, ns_object):
                continue
            try:
                _judge(policy, request, obj, old, ns_object)
            except _Refused as refused:
                qualified = plural + (f".{group}" if group else "")
                message = (f'{qualified} "{request["name"]}" is forbidden: ValidatingAdmissionPolicy '
                           f"'{policy['metadata']['name']}' with binding '{binding['metadata']['name']}' denied request: "
                           f"{refused.message}")
                raise ApiError(REASON_CODES.get(refused.reason, 422), refused.reason, message,
                               {"name": request["name"], "kind": plural, "causes": [{"message": message}]}) from None


def _request(user: str, operation: str, group: str, plural: str, namespace: str, target: dict) -> dict:
    groups = ["system:authenticated"]
    if user.startswith("system:serviceaccount:"):
        groups += ["system:serviceaccounts", f"system:serviceaccounts:{user.split(':')[2]}"]
    version = (target.get("apiVersion") or "v1").rpartition("/")[2]
    return {"operation": operation, "name": target["metadata"]["name"], "namespace": namespace,
            "userInfo": {"username": str(user), "groups": groups, **({"extra": user.extra} if getattr(user, "extra", None) else {})},
            "resource": {"group": group, "version": version, "resource": plural},
            "kind": {"group": group, "version": version, "kind": target.get("kind", "")}}


def _selected(selector: dict | None, labels: dict | None) -> bool:
    if not selector:
        return True
    if selector.get("matchExpressions"):
        raise NotImplementedError("matchExpressions in a policy's selectors are not modelled")
    return all((labels or {}).get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def _rule_matches(rule: dict, request: dict) -> bool:
    resource = request["resource"]
    wanted = (("apiGroups", resource["group"]), ("apiVersions", resource["version"]),
              ("operations", request["operation"]), ("resources", resource["resource"]))
    return all("*" in (rule.get(field) or []) or value in (rule.get(field) or []) for field, value in wanted)


def _matches(match: dict, request: dict, target: dict, ns_object: dict | None) -> bool:
    """matchConstraints (a policy's) or matchResources (a binding's; no rules: every request)."""
    rules = match.get("resourceRules")
    if rules is not None and not any(_rule_matches(rule, request) for rule in rules):
        return False
    if any(_rule_matches(rule, request) for rule in match.get("excludeResourceRules") or []):
        return False
    ns_labels = ((ns_object or {}).get("metadata") or {}).get("labels")
    return _selected(match.get("namespaceSelector"), ns_labels) and _selected(match.get("objectSelector"),
                                                                              target["metadata"].get("labels"))


def _judge(policy: dict, request: dict, obj, old, ns_object) -> None:
    """Raise _Refused unless the policy's validations all hold."""
    spec = policy["spec"]
    if spec.get("paramKind"):
        raise NotImplementedError("a policy's parameters (paramKind) are not modelled")
    fail_open = spec.get("failurePolicy") == "Ignore"
    context = {"object": obj, "oldObject": old, "request": request, "namespaceObject": ns_object}
    activation = {name: celpy.json_to_cel(value) for name, value in context.items()}
    try:
        if not all(_true(_evaluate(c["expression"], activation)) for c in spec.get("matchConditions") or []):
            return
    except _EvaluationError as exc:
        if not fail_open:
            raise _Refused(str(exc)) from None
        return
    activation["variables"] = _Variables(spec.get("variables") or [], activation)
    for validation in spec.get("validations") or []:
        try:
            holds = _true(_evaluate(validation["expression"], activation))
        except _EvaluationError as exc:
            if fail_open:
                continue
            raise _Refused(str(exc)) from None
        if not holds:
            raise _Refused(_message(validation, activation), validation.get("reason") or "Invalid")


def _message(validation: dict, activation: dict) -> str:
    if validation.get("messageExpression"):
        try:
            text = _evaluate(validation["messageExpression"], activation)
            if isinstance(text, str) and text.strip() and "\n" not in text.strip():
                return text.strip()
        except _EvaluationError:
            pass  # the server logs it and falls back, as here
    return (validation.get("message") or "").strip() or f"failed expression: {validation['expression'].strip()}"


class _EvaluationError(Exception):
    pass


class _Variables(celtypes.MapType):
    """`variables`: each evaluated when first used, then kept, as the server's are (a variable that
    would fail on this request, and is not used on it, refuses nothing)."""

    def __init__(self, variables: list[dict], activation: dict):
        super().__init__({})
        self.expressions = {celtypes.StringType(v["name"]): v["expression"] for v in variables}
        self.activation = activation

    def __contains__(self, key) -> bool:
        return key in self.expressions

    def __getitem__(self, key):
        if not super().__contains__(key) and key in self.expressions:
            try:
                value = _evaluate(self.expressions[key], self.activation)
            except _EvaluationError as exc:
                value = celpy.CELEvalError(str(exc))  # an error value: CEL's && and || may still absorb it
            super().__setitem__(key, value)
        return super().__getitem__(key)


def _substring(text, start, end=None):
    """cel-go's ext.Strings `string.substring(start[, end])`: code points; an index out of range is an error."""
    end = len(text) if end is None else int(end)
    if not 0 <= int(start) <= end <= len(text):
        return celpy.CELEvalError(f"index out of range: {start}, {end}")
    return celtypes.StringType(text[int(start):end])


_FUNCTIONS = {"substring": _substring}
_PROGRAMS: dict[str, object] = {}


def _evaluate(expression: str, activation: dict):
    program = _PROGRAMS.get(expression)
    if program is None:
        environment = celpy.Environment()
        program = _PROGRAMS[expression] = environment.program(environment.compile(expression), functions=_FUNCTIONS)
    try:
        result = program.evaluate(activation)
    except celpy.CELEvalError as exc:
        raise _EvaluationError(f"expression '{expression.strip()}' resulted in error: {exc.args[0]}") from None
    if isinstance(result, celpy.CELEvalError):
        raise _EvaluationError(f"expression '{expression.strip()}' resulted in error: {result.args[0]}")
    return result


def _true(value) -> bool:
    if not isinstance(value, celtypes.BoolType):
        raise _EvaluationError(f"expression returned {type(value).__name__}, not a bool")
    return bool(value)
