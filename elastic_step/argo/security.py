"""The security context of every step pod: Pod Security Standards' `restricted` profile, which a
Kubeflow profile namespace or any namespace labelled `pod-security.kubernetes.io/enforce:
restricted` demands. The train step's pod is the elastic master and holds the runner's token, so it
runs as the image's non-root user, with no capabilities, no privilege escalation and the
runtime's default seccomp filter.

The pod-level context (the workflow's `securityContext`) covers every container of a step pod,
Argo's own `init` and `wait` included, for the user and the seccomp profile. Privilege escalation
and capabilities are per container in Kubernetes: the template's container sets them for `main`;
Argo gives its `init` and `wait` containers the workflow controller's `executor.securityContext`
(workflow-controller-configmap), which a restricted namespace needs set as README shows."""

from __future__ import annotations

from hera.workflows import models as m

from elastic_step.images import IMAGE_USER

RUNTIME_DEFAULT = m.SeccompProfile(type="RuntimeDefault")


def restricted_pod() -> m.PodSecurityContext:
    # No runAsUser here: Argo's executor image runs as its own non-root user, ours as IMAGE_USER.
    return m.PodSecurityContext(run_as_non_root=True, seccomp_profile=RUNTIME_DEFAULT)


def restricted_container() -> m.SecurityContext:
    return m.SecurityContext(run_as_non_root=True, run_as_user=IMAGE_USER, run_as_group=IMAGE_USER,
                             allow_privilege_escalation=False, capabilities=m.Capabilities(drop=["ALL"]),
                             seccomp_profile=RUNTIME_DEFAULT)


# The workflow controller's `executor.securityContext` (workflow-controller-configmap, the `executor`
# key) for a restricted namespace: Argo copies it onto every step pod's `init` and `wait` containers.
EXECUTOR_SECURITY_CONTEXT = {"runAsNonRoot": True, "allowPrivilegeEscalation": False,
                             "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
