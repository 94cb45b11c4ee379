"""The API server's admission of a pod, in kube-apiserver's order and words: defaults and the
ServiceAccount plugin, PodSecurity, ResourceQuota. Each refusal is the server's 403 Forbidden.

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
