"""What a worker pod's status means for its worker: a declarative table, read top to bottom,
first match wins. Each row names a condition of the pod (facts read from the client's V1Pod)
and the verdict: still starting, running, or gone — and then whether to relaunch it free (the
cluster took it away), counted (the worker failed), or never (relaunching cannot help)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kubernetes import client as k8s

from elastic_step.backends.api import RelaunchPolicy
from elastic_step.protocol import WORKER_LEFT_EXIT_CODE

IMAGE_ERRORS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")
# A pod stuck waiting with one of these never starts by itself; after the pending timeout it is a job error.
STUCK_WAITING = IMAGE_ERRORS + ("CreateContainerConfigError", "CreateContainerError")
# DisruptionTarget reasons (Kubernetes >= 1.26): the cluster, not the worker, ended the pod.
PREEMPTION = ("PreemptionByScheduler", "PreemptionByKubeScheduler")
EVICTION = ("EvictionByEvictionAPI", "TerminationByKubelet", "DeletionByTaintManager", "DeletionByPodGC")
NODE_LOSS = ("NodeLost", "Shutdown", "NodeShutdown", "Terminated", "UnexpectedAdmissionError")
# What kube-scheduler adds to an Unschedulable message when no node could ever take the pod (a
# request beyond every node's allocatable, a node selector no node matches): freeing capacity,
# by preemption or by other jobs ending, cannot help. Without it the pod waits for capacity.
NEVER_FITS = "Preemption is not helpful for scheduling"


@dataclass
class PodFacts:
    """Everything the table looks at, read once from a V1Pod."""

    name: str
    deleted: bool  # a DELETED event, or gone from a re-list
    deleting: bool  # deletionTimestamp set
    we_deleted: bool  # the master asked for the deletion (stop, scale-in clean-up)
    phase: str
    pod_reason: str
    pod_message: str
    disruption: str  # the DisruptionTarget condition's reason, if any
    unschedulable: str  # the PodScheduled=False message, if Unschedulable
    waiting: str  # the container's waiting reason
    waiting_message: str
    terminated: str  # the container's terminated reason (OOMKilled, Error, Completed)
    exit_code: int | None
    signal: int | None
    memory_limit: str
    image: str
    pending_s: float  # how long it has been stuck (waiting or unschedulable), 0 if not
    pending_timeout_s: float


@dataclass
class Verdict:
    state: str  # "starting" | "running" | "stopping" (deleted, its container not ended yet) | "gone"
    reason: str = ""
    relaunch: RelaunchPolicy = "count"
    returncode: int | None = None
    left: bool = False  # the worker left on SIGTERM: a departure, not a failure


def read_facts(
    pod: k8s.V1Pod, *, deleted: bool, we_deleted: bool, pending_s: float = 0.0, pending_timeout_s: float = 300.0
) -> PodFacts:
    status = pod.status or k8s.V1PodStatus()
    conditions = {c.type: c for c in status.conditions or []}
    disruption = conditions.get("DisruptionTarget")
    scheduled = conditions.get("PodScheduled")
    container = next(iter(status.container_statuses or []), None)
    state = (container.state if container else None) or k8s.V1ContainerState()
    if state.terminated is None and container is not None and container.last_state is not None:
        state = container.last_state if container.last_state.terminated else state
    spec_container = next(iter(pod.spec.containers), None) if pod.spec else None
    limits = (spec_container.resources.limits or {}) if spec_container and spec_container.resources else {}
    return PodFacts(
        name=pod.metadata.name,
        deleted=deleted,
        deleting=pod.metadata.deletion_timestamp is not None,
        we_deleted=we_deleted,
        phase=status.phase or "Pending",
        pod_reason=status.reason or "",
        pod_message=status.message or "",
        disruption=(disruption.reason or "DisruptionTarget") if disruption is not None and disruption.status == "True" else "",
        unschedulable=(scheduled.message or "unschedulable")
        if scheduled is not None and scheduled.status == "False" and scheduled.reason == "Unschedulable"
        else "",
        waiting=state.waiting.reason or "" if state.waiting else "",
        waiting_message=state.waiting.message or "" if state.waiting else "",
        terminated=state.terminated.reason or "" if state.terminated else "",
        exit_code=state.terminated.exit_code if state.terminated else None,
        signal=state.terminated.signal if state.terminated else None,
        memory_limit=str(limits.get("memory", "")),
        image=spec_container.image if spec_container else "",
        pending_s=pending_s,
        pending_timeout_s=pending_timeout_s,
    )


def _exit_text(f: PodFacts) -> str:
    if f.exit_code is None:
        return "ended without an exit code"
    if f.exit_code > 128:
        import signal as signals

        try:
            return f"exited with code {f.exit_code} ({signals.Signals(f.exit_code - 128).name})"
        except ValueError:
            pass
    return f"exited with code {f.exit_code}"


def _stuck(f: PodFacts) -> bool:
    return f.pending_s >= f.pending_timeout_s


Rule = tuple[str, Callable[[PodFacts], bool], Callable[[PodFacts], Verdict]]


def _still_running(f: PodFacts) -> bool:
    """Its container has not ended: no terminated state, and the pod is not Succeeded or Failed."""
    return f.exit_code is None and f.phase not in ("Succeeded", "Failed")


# (name, when, verdict) — the order is the policy.
TABLE: list[Rule] = [
    # Someone else's graceful delete (kubectl delete pod, a drain, an eviction, a preemption): the
    # kubelet has SIGTERMed the worker, which leaves the group at once. It is reported gone when
    # its container has ended (or the pod is gone), never while it may still talk to the master,
    # and the pod is left to its grace period: deleting it again with grace 0 would SIGKILL it.
    ("being deleted by someone else",
     lambda f: f.deleting and not f.deleted and not f.we_deleted and _still_running(f),
     lambda f: Verdict("stopping", f"pod {f.name} is being deleted by someone else")),
    ("out of memory",
     lambda f: f.terminated == "OOMKilled",
     lambda f: Verdict("gone", f"pod {f.name} OOMKilled (memory limit {f.memory_limit or 'none: the node ran out'}); "
                       "raise --worker-memory or lower the batch size", "never", f.exit_code)),
    ("preempted",
     lambda f: f.disruption in PREEMPTION,
     lambda f: Verdict("gone", f"pod {f.name} preempted by a higher-priority pod", "free", f.exit_code)),
    ("evicted",
     lambda f: f.pod_reason == "Evicted" or f.disruption in EVICTION,
     lambda f: Verdict("gone", f"pod {f.name} evicted ({f.disruption or f.pod_reason}: {f.pod_message or 'no message'})",
                       "free", f.exit_code)),
    ("node lost",
     lambda f: f.pod_reason in NODE_LOSS,
     lambda f: Verdict("gone", f"pod {f.name} lost with its node ({f.pod_reason}: {f.pod_message or 'no message'})",
                       "free", f.exit_code)),
    ("deleted by someone else",
     lambda f: (f.deleted or f.deleting) and not f.we_deleted,
     lambda f: Verdict("gone", f"pod {f.name} deleted by someone else"
                       + (f" (the worker left on SIGTERM, {_exit_text(f)})" if f.exit_code == WORKER_LEFT_EXIT_CODE else ""),
                       "free", f.exit_code, left=f.exit_code == WORKER_LEFT_EXIT_CODE)),
    ("stopped by the master",
     lambda f: (f.deleted or f.deleting) and f.we_deleted,
     lambda f: Verdict("gone", f"pod {f.name} deleted by the master", "count", f.exit_code)),
    ("finished",
     lambda f: f.phase == "Succeeded",
     lambda f: Verdict("gone", "exited with code 0", "count", 0)),
    # SIGTERM with none of the causes above (a person's or a tool's kill in the pod): the worker
    # left through its handler, or SIGTERM ended it, which the runtime reports as the same code.
    ("left on SIGTERM",
     lambda f: f.phase == "Failed" and f.exit_code == WORKER_LEFT_EXIT_CODE,
     lambda f: Verdict("gone", f"pod {f.name} left on SIGTERM ({_exit_text(f)})", "free", f.exit_code, left=True)),
    ("failed",
     lambda f: f.phase == "Failed",
     lambda f: Verdict("gone", f"pod {f.name} {_exit_text(f)}" + (f" ({f.terminated})" if f.terminated not in ("", "Error") else ""),
                       "count", f.exit_code)),
    ("invalid image",
     lambda f: f.waiting in ("InvalidImageName", "ErrImageNeverPull"),
     lambda f: Verdict("gone", f"pod {f.name} cannot start: {f.waiting} for image {f.image!r}: {f.waiting_message}; "
                       "pass --image with an image the nodes can pull", "never")),
    ("image cannot be pulled",
     lambda f: f.waiting in IMAGE_ERRORS and _stuck(f),
     lambda f: Verdict("gone", f"pod {f.name} could not pull image {f.image!r} for {f.pending_s:.0f}s ({f.waiting}: "
                       f"{f.waiting_message or 'no message'}); check --image and --image-pull-secret", "never")),
    # Only a pod no node can ever take is given up; one that waits for capacity (other pods hold
    # it) waits as long as it takes: the job runs shrunk and grows back when capacity returns.
    ("cannot be scheduled",
     lambda f: NEVER_FITS in f.unschedulable and _stuck(f),
     lambda f: Verdict("gone", f"pod {f.name} unschedulable for {f.pending_s:.0f}s ({f.unschedulable}); lower "
                       "--worker-cpu/--worker-memory/--worker-gpus or check --node-selector and --toleration", "never")),
    ("cannot be created",
     lambda f: f.waiting in STUCK_WAITING and _stuck(f),
     lambda f: Verdict("gone", f"pod {f.name} stuck in {f.waiting} for {f.pending_s:.0f}s: {f.waiting_message}", "never")),
    ("running",
     lambda f: f.phase == "Running",
     lambda f: Verdict("running")),
    ("starting",
     lambda f: True,
     lambda f: Verdict("starting")),
]


def judge(facts: PodFacts) -> tuple[str, Verdict]:
    """The first row that matches: (its name, its verdict)."""
    for name, when, verdict in TABLE:
        if when(facts):
            return name, verdict(facts)
    raise AssertionError("the table ends with a catch-all row")


def is_stuck_waiting(facts: PodFacts) -> bool:
    """A pending pod that will not start by itself: its clock towards the pending timeout runs."""
    return facts.phase == "Pending" and (facts.waiting in STUCK_WAITING or NEVER_FITS in facts.unschedulable)
