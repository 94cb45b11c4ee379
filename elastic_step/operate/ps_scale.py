"""`elastic-step scale JOB --ps N` of a job on Kubernetes. The master's port admits only its
workers, so, as `scale --workers`, the request is an annotation on the job's status ConfigMap
("N/REQUEST"), which the master takes in at its next publish; once the rows have moved it
answers in the status it publishes there (`ps_scales`: the newest requests' answers, each naming
its request). With the caller's own credentials and no more than `scale --workers` needs:
configmaps list (to find and read the job's) and patch (to ask), as deploy/operator's Role grants."""

from __future__ import annotations

import time
import uuid

from elastic_step.backends.kubernetes.manifests import PS_SCALE_ANNOTATION
from elastic_step.errors import ElasticStepError
from elastic_step.operate.api import PS_MOVE_TIMEOUT_S
from elastic_step.operate.statusmap import instance_of, published_document, published_job, status_map

POLL_S = 1.0
ANSWER_TIMEOUT_S = PS_MOVE_TIMEOUT_S  # as long as the local backend's API call waits for the move
# What the CLI prints of a move (ps/moves.py's MoveReport.to_json), checked: the ConfigMap is
# writable by anyone with the operator's Role, not only by the master.
MOVE_KEYS = ("epoch", "moved", "virtual_shards", "rows_moved", "rows_total", "seconds", "pause_max_s")


def scale_ps_kubernetes(job: str, namespace: str, shards: int, api) -> dict:
    """Ask job `job`'s master for `shards` parameter-server shards and wait for its answer:
    {"job", "ps_scale": what moved}; its refusal as an error."""
    found = status_map(api, namespace, job)
    if found is None:
        raise ElasticStepError(f"no running job {job!r} in namespace {namespace}; there is nothing to scale")
    loaded = published_job(found, namespace)
    status = loaded["status"]
    if not loaded["live"]:
        raise ElasticStepError(f"job {job} has ended ({status.get('state')}); there is nothing to scale")
    if not status.get("ps_shards"):
        raise ElasticStepError(f"job {job} has no parameter-server shards: scale --ps is for a job trained with --mode ps")
    request = uuid.uuid4().hex[:12]
    try:
        api.patch_namespaced_config_map(found.metadata.name, namespace,
                                        {"metadata": {"annotations": {PS_SCALE_ANNOTATION: f"{shards}/{request}"}}})
    except Exception as exc:
        raise ElasticStepError(f"cannot ask job {job} to scale its shards: {getattr(exc, 'reason', None) or exc} on ConfigMap "
                               f"{found.metadata.name}; you need deploy/operator's Role in {namespace} (configmaps patch)") from None
    answer = _answer(api, namespace, found, job, request)
    if "refused" in answer:
        raise ElasticStepError(f"job {job} cannot run {shards} parameter-server shards: {answer['refused']}")
    return {"job": status.get("job", job), "ps_scale": _checked_move(answer.get("moved"), found.metadata.name)}


def _answer(api, namespace: str, found, job: str, request: str) -> dict:
    """The master's answer to `request`, once it has one: {"moved": ...} or {"refused": ...}."""
    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    taken = False
    while time.monotonic() < deadline:
        current = status_map(api, namespace, instance_of(found))  # this instance: the name may be taken again meanwhile
        if current is None or current.metadata.name != found.metadata.name:
            raise ElasticStepError(f"job {job} ended before its master answered the scale --ps; "
                                   f"`elastic-step get --backend kubernetes {job} --mlflow-uri URI` shows how")
        answer = _answer_to(published_document(current, namespace), request)
        if answer is not None:
            taken = True
            if "moved" in answer or "refused" in answer:
                return answer
        time.sleep(POLL_S)
    where = "its rows are still moving" if taken else "its master has not taken the request"
    raise ElasticStepError(f"job {job} did not answer the scale --ps within {ANSWER_TIMEOUT_S:.0f}s ({where}); "
                           f"see `elastic-step get --backend kubernetes {job} -e`")


def _answer_to(document: dict, request: str) -> dict | None:
    """The published answer naming `request`, if the master has taken it."""
    answers = document.get("ps_scales")
    if not isinstance(answers, list):
        return None
    return next((a for a in answers if isinstance(a, dict) and a.get("request") == request), None)


def _checked_move(moved, config_map: str) -> dict:
    if not isinstance(moved, dict) or not all(isinstance(moved.get(key), (int, float)) for key in MOVE_KEYS):
        raise ElasticStepError(f"the answer to the scale --ps in ConfigMap {config_map} is not a move's report; "
                               "it was changed by hand: see `elastic-step get --backend kubernetes JOB -e` for what moved")
    return moved
