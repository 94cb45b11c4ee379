"""Pod Security Standards, as the API server's PodSecurity admission evaluates a pod: the checks of
the `baseline` and `restricted` levels, each with the ID, reason and allowed values of its
counterpart in kubernetes `staging/src/k8s.io/pod-security-admission/policy/check_*.go` (latest
versions of each check). `violations(pod, level)` returns what admission would refuse, as
(check ID, forbidden reason, detail), empty for a pod that is admitted.

Every container counts: init, regular and ephemeral (the policy's `visitContainers`). Where a
field may be set on the pod or on each container (runAsNonRoot, seccompProfile), a container-level
value overrides, and an unset container is covered by a valid pod-level value. Not modelled: the
relaxations for pods in a user namespace (`hostUsers: false`) and Windows pods; the version
pinning of each check (every check here applies from the oldest version PSA ships)."""

from __future__ import annotations

from collections.abc import Callable

BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
                         "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
                      "secret"}
VALID_SECCOMP = {"RuntimeDefault", "Localhost"}

Violation = tuple[str, str, str]


def containers(spec: dict) -> list[dict]:
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or []) + \
        list(spec.get("ephemeralContainers") or [])


def _sc(container: dict) -> dict:
    return container.get("securityContext") or {}


def _names(items: list[dict]) -> str:
    return ", ".join(f'"{c["name"]}"' for c in items)


# baseline ---------------------------------------------------------------------------------------

def host_namespaces(meta: dict, spec: dict) -> Violation | None:
    used = [f for f in ("hostNetwork", "hostPID", "hostIPC") if spec.get(f)]
    return ("hostNamespaces", "host namespaces", ", ".join(f"{f}=true" for f in used)) if used else None


def privileged(meta: dict, spec: dict) -> Violation | None:
    bad = [c for c in containers(spec) if _sc(c).get("privileged")]
    return ("privileged", "privileged", f"containers {_names(bad)} must not set securityContext.privileged=true") if bad else None


def capabilities_baseline(meta: dict, spec: dict) -> Violation | None:
    added = {cap for c in containers(spec) for cap in (_sc(c).get("capabilities") or {}).get("add") or []}
    bad = sorted(added - BASELINE_CAPABILITIES)
    return ("capabilities_baseline", "non-default capabilities", f"capabilities.add {bad}") if bad else None


def host_path_volumes(meta: dict, spec: dict) -> Violation | None:
    bad = [v["name"] for v in spec.get("volumes") or [] if "hostPath" in v]
    return ("hostPathVolumes", "hostPath volumes", f"volumes {bad}") if bad else None


def host_ports(meta: dict, spec: dict) -> Violation | None:
    bad = [p["hostPort"] for c in containers(spec) for p in c.get("ports") or [] if p.get("hostPort")]
    return ("hostPorts", "hostPort", f"hostPorts {bad}") if bad else None


def app_armor(meta: dict, spec: dict) -> Violation | None:
    profiles = [(spec.get("securityContext") or {}).get("appArmorProfile")] + \
        [_sc(c).get("appArmorProfile") for c in containers(spec)]
    bad = [p for p in profiles if p and p.get("type") == "Unconfined"]
    bad += [v for k, v in (meta.get("annotations") or {}).items()
            if k.startswith("container.apparmor.security.beta.kubernetes.io/") and v not in ("runtime/default",)
            and not v.startswith("localhost/")]
    return ("appArmorProfile", "forbidden AppArmor profile", str(bad)) if bad else None


def selinux_options(meta: dict, spec: dict) -> Violation | None:
    options = [(spec.get("securityContext") or {}).get("seLinuxOptions")] + \
        [_sc(c).get("seLinuxOptions") for c in containers(spec)]
    bad = [o for o in options if o and (o.get("type", "") not in SELINUX_TYPES or o.get("user") or o.get("role"))]
    return ("seLinuxOptions", "seLinuxOptions", str(bad)) if bad else None


def proc_mount(meta: dict, spec: dict) -> Violation | None:
    bad = [c for c in containers(spec) if _sc(c).get("procMount") not in (None, "Default")]
    return ("procMount", "procMount", f"containers {_names(bad)} must not set securityContext.procMount") if bad else None


def seccomp_baseline(meta: dict, spec: dict) -> Violation | None:
    profiles = [(spec.get("securityContext") or {}).get("seccompProfile")] + [_sc(c).get("seccompProfile") for c in containers(spec)]
    bad = [p for p in profiles if p and p.get("type") == "Unconfined"]
    return ("seccompProfile_baseline", "seccompProfile", 'type "Unconfined"') if bad else None


def sysctls(meta: dict, spec: dict) -> Violation | None:
    bad = [s["name"] for s in (spec.get("securityContext") or {}).get("sysctls") or [] if s["name"] not in SAFE_SYSCTLS]
    return ("sysctls", "forbidden sysctls", str(bad)) if bad else None


def windows_host_process(meta: dict, spec: dict) -> Violation | None:
    options = [(spec.get("securityContext") or {}).get("windowsOptions")] + [_sc(c).get("windowsOptions") for c in containers(spec)]
    return ("windowsHostProcess", "hostProcess", "hostProcess=true") if any(o and o.get("hostProcess") for o in options) else None


# restricted -------------------------------------------------------------------------------------

def restricted_volumes(meta: dict, spec: dict) -> Violation | None:
    bad = [v["name"] for v in spec.get("volumes") or [] if not set(v) - {"name"} <= RESTRICTED_VOLUMES]
    return ("restrictedVolumes", "restricted volume types", f"volumes {bad}") if bad else None


def allow_privilege_escalation(meta: dict, spec: dict) -> Violation | None:
    bad = [c for c in containers(spec) if _sc(c).get("allowPrivilegeEscalation") is not False]
    return ("allowPrivilegeEscalation", "allowPrivilegeEscalation != false",
            f"containers {_names(bad)} must set securityContext.allowPrivilegeEscalation=false") if bad else None


def _pod_or_containers(spec: dict, field: str, valid: Callable[[object], bool]) -> tuple[list[str], list[dict]]:
    """(setters of a bad value, containers left unset with no valid pod-level value)."""
    bad_setters, pod_valid = [], False
    pod_value = (spec.get("securityContext") or {}).get(field)
    if pod_value is not None:
        if valid(pod_value):
            pod_valid = True
        else:
            bad_setters.append("pod")
    unset = []
    for c in containers(spec):
        value = _sc(c).get(field)
        if value is None:
            if not pod_valid:
                unset.append(c)
        elif not valid(value):
            bad_setters.append(f'container "{c["name"]}"')
    return bad_setters, unset


def run_as_non_root(meta: dict, spec: dict) -> Violation | None:
    bad, unset = _pod_or_containers(spec, "runAsNonRoot", lambda v: v is True)
    if bad:
        return ("runAsNonRoot", "runAsNonRoot != true", f"{' and '.join(bad)} must not set securityContext.runAsNonRoot=false")
    if unset:
        return ("runAsNonRoot", "runAsNonRoot != true", f"pod or containers {_names(unset)} must set securityContext.runAsNonRoot=true")
    return None


def run_as_user(meta: dict, spec: dict) -> Violation | None:
    bad = (["pod"] if (spec.get("securityContext") or {}).get("runAsUser") == 0 else []) + \
        [c["name"] for c in containers(spec) if _sc(c).get("runAsUser") == 0]
    return ("runAsUser", "runAsUser=0", f"{bad} must not set runAsUser=0") if bad else None


def seccomp_restricted(meta: dict, spec: dict) -> Violation | None:
    bad, unset = _pod_or_containers(spec, "seccompProfile", lambda v: (v or {}).get("type") in VALID_SECCOMP)
    if bad:
        return ("seccompProfile_restricted", "seccompProfile", f"{' and '.join(bad)} must not set a seccompProfile.type "
                                                              "other than RuntimeDefault or Localhost")
    if unset:
        return ("seccompProfile_restricted", "seccompProfile",
                f'pod or containers {_names(unset)} must set securityContext.seccompProfile.type to "RuntimeDefault" or "Localhost"')
    return None


def capabilities_restricted(meta: dict, spec: dict) -> Violation | None:
    missing = [c for c in containers(spec) if "ALL" not in ((_sc(c).get("capabilities") or {}).get("drop") or [])]
    adding = [c for c in containers(spec) if set((_sc(c).get("capabilities") or {}).get("add") or []) - {"NET_BIND_SERVICE"}]
    details = ([f'containers {_names(missing)} must set securityContext.capabilities.drop=["ALL"]'] if missing else []) + \
        ([f"containers {_names(adding)} must not add capabilities other than NET_BIND_SERVICE"] if adding else [])
    return ("capabilities_restricted", "unrestricted capabilities", "; ".join(details)) if details else None


BASELINE = (host_namespaces, privileged, capabilities_baseline, host_path_volumes, host_ports, app_armor,
            selinux_options, proc_mount, seccomp_baseline, sysctls, windows_host_process)
RESTRICTED = BASELINE + (restricted_volumes, allow_privilege_escalation, run_as_non_root, run_as_user,
                         seccomp_restricted, capabilities_restricted)
LEVELS = {"baseline": BASELINE, "restricted": RESTRICTED}


def violations(pod: dict, level: str = "restricted") -> list[Violation]:
    """What PodSecurity admission at `level` refuses in `pod` (a Pod manifest as a dict)."""
    meta, spec = pod.get("metadata") or {}, pod["spec"]
    return [v for check in LEVELS[level] if (v := check(meta, spec)) is not None]
