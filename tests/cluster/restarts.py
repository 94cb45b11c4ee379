"""When the kubelet restarts a container in place, as pkg/kubelet/kuberuntime does it:
`restartPolicy: Always` restarts every exit, `OnFailure` a non-zero one, `Never` none; the first
restart is at once, each later one after a back-off that starts at 10 s and doubles up to 5 min
(the container meanwhile `waiting` with reason `CrashLoopBackOff`). The pod stays Running while a
container is to be restarted; its status counts `restartCount` and keeps the ended instance as
`lastState.terminated`; `pods/log?previous=true` reads that instance's log. A pod being deleted
or evicted is never restarted."""

from __future__ import annotations

BACKOFF_START_S = 10.0
BACKOFF_MAX_S = 300.0


def restart_delay(policy: str, exit_code: int, restarts_so_far: int) -> float | None:
    """Seconds until the ended container starts again; None: it stays ended."""
    if policy == "Never" or (policy == "OnFailure" and exit_code == 0):
        return None
    if restarts_so_far == 0:
        return 0.0
    return min(BACKOFF_START_S * 2 ** (restarts_so_far - 1), BACKOFF_MAX_S)


def back_off_message(seconds: float, container: str, pod: str, namespace: str, uid: str) -> str:
    return f"back-off {int(seconds)}s restarting failed container={container} pod={pod}_{namespace}({uid})"
