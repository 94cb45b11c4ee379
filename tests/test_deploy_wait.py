"""deploy's wait for Ready ends as soon as the cluster reports the rollout failed, not at its
timeout: KServe's Ready condition with a Knative failure reason (the revision's container exited),
or a server pod of the new template that exited with an error or cannot start. The statuses are
the API's own shapes, given to ServingCluster through a fake client; the cluster stand-in's run of
the same (tests/test_cluster_deploy.py) rolls back a bad version this way."""

from __future__ import annotations

import time
from unittest import mock

import pytest
from kubernetes import client as k8s

from elastic_step.errors import JobFailed
from elastic_step.release.deploy_apply import ServingCluster, pod_failure
from elastic_step.release.deploy_render import Track

LABELS = {"app.kubernetes.io/instance": "digits", "elastic-step.io/track": "canary", "elastic-step.io/model-version": "3"}


def pod(*statuses: dict, deleting: bool = False, init: tuple = ()) -> dict:
    meta = {"name": "digits-canary-5d8f-x2x9q", "labels": LABELS}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-06T07:00:00Z"
    return {"metadata": meta, "status": {"phase": "Running", "containerStatuses": list(statuses),
                                         "initContainerStatuses": list(init)}}


RUNNING = {"name": "model-server", "ready": False, "restartCount": 0, "state": {"running": {"startedAt": "t"}}}
EXITED = {"name": "model-server", "ready": False, "restartCount": 1, "state": {"running": {"startedAt": "t"}},
          "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}}}
LOOPING = {"name": "model-server", "ready": False, "restartCount": 2,
           "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s restarting failed container"}},
           "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": "model.pth: not a model\n"}}}
NO_IMAGE = {"name": "model-server", "ready": False, "restartCount": 0,
            "state": {"waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "registry.example/nope:1"'}}}


@pytest.mark.parametrize("status, says", [
    (pod(RUNNING), ""),  # starting: its probe may yet pass
    (pod(EXITED), "pod digits-canary-5d8f-x2x9q: container model-server exited with code 1 (Error)"),
    (pod(LOOPING), "pod digits-canary-5d8f-x2x9q: container model-server exited with code 1 (Error, CrashLoopBackOff): "
                   "model.pth: not a model"),
    (pod(NO_IMAGE), 'pod digits-canary-5d8f-x2x9q: container model-server is waiting in ImagePullBackOff: Back-off pulling '
                    'image "registry.example/nope:1"'),
    (pod(init=({"name": "storage-initializer", "state": {"terminated": {"exitCode": 2, "reason": "Error"}}},)),
     "pod digits-canary-5d8f-x2x9q: container storage-initializer exited with code 2 (Error)"),
    (pod(init=({"name": "storage-initializer", "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}},)), ""),
    (pod(LOOPING, deleting=True), ""),  # a pod going away says nothing of the rollout
])
def test_a_pod_is_a_failed_rollout_once_its_container_exited_with_an_error_or_cannot_start(status, says):
    assert pod_failure(status) == says


def deployment(updated: int, available: int) -> k8s.V1Deployment:
    template = k8s.V1PodTemplateSpec(metadata=k8s.V1ObjectMeta(labels=LABELS))
    return k8s.V1Deployment(metadata=k8s.V1ObjectMeta(name="digits-canary", generation=2),
                            spec=k8s.V1DeploymentSpec(replicas=1, selector=k8s.V1LabelSelector(match_labels=LABELS), template=template),
                            status=k8s.V1DeploymentStatus(observed_generation=2, replicas=updated, updated_replicas=updated,
                                                          available_replicas=available))


def serving(pods: list[dict], deployments: list[k8s.V1Deployment] | None = None, isvc: dict | None = None) -> ServingCluster:
    cluster = ServingCluster(k8s.ApiClient(), "ml")
    cluster.apps, cluster.core, cluster.custom = mock.Mock(), mock.Mock(), mock.Mock()
    cluster.apps.read_namespaced_deployment.side_effect = deployments or [deployment(1, 0)] * 1000
    cluster.core.list_namespaced_pod.return_value = {"items": pods}
    cluster.custom.get_namespaced_custom_object.return_value = isvc
    return cluster


def test_the_wait_for_a_deployment_fails_at_once_when_its_new_pod_exited_and_lists_only_the_new_templates_pods():
    cluster = serving([pod(LOOPING)])
    started = time.monotonic()
    with pytest.raises(JobFailed, match=r"^Deployment digits-canary failed its rollout \(1/1 replicas updated, 0 available\): "
                                        r"pod digits-canary-5d8f-x2x9q: container model-server exited with code 1 "
                                        r"\(Error, CrashLoopBackOff\): model.pth: not a model$"):
        cluster.wait_deployment("digits", Track.CANARY, timeout=300)
    assert time.monotonic() - started < 5  # not its 300 s
    (call,) = cluster.core.list_namespaced_pod.call_args_list
    assert call.args == ("ml",) and call.kwargs["label_selector"] == ",".join(f"{k}={v}" for k, v in sorted(LABELS.items()))


def test_a_deployment_whose_pod_only_starts_is_waited_for_until_ready_or_the_timeout():
    cluster = serving([pod(RUNNING)], deployments=[deployment(1, 0), deployment(1, 1)])
    cluster.wait_deployment("digits", Track.CANARY, timeout=30)  # Ready on the second look
    cluster = serving([pod(RUNNING)])
    with pytest.raises(JobFailed, match=r"^Deployment digits-canary was not Ready within 1s \(1/1 replicas updated, 0 available\)"):
        cluster.wait_deployment("digits", Track.CANARY, timeout=1)


def isvc(reason: str, message: str) -> dict:
    condition = {"status": "False", "reason": reason, "message": message}
    return {"metadata": {"name": "kdigits", "generation": 3},
            "status": {"observedGeneration": 3, "url": "http://kdigits.ml.example.com",
                       "conditions": [{"type": "PredictorReady", **condition}, {"type": "Ready", **condition}]}}


def test_the_wait_for_an_inference_service_fails_at_once_on_kserves_revision_failed():
    failed = 'Revision "kdigits-predictor-00003" failed with message: container kserve-container exited with code 1.'
    cluster = serving([], isvc=isvc("RevisionFailed", failed))
    started = time.monotonic()
    with pytest.raises(JobFailed, match=rf"^InferenceService 'kdigits' failed its rollout: {failed}$".replace(".", r"\.")):
        cluster.wait_inference_service("kdigits", 3, timeout=300)
    assert time.monotonic() - started < 5


def test_an_inference_service_not_ready_yet_or_failed_at_an_older_generation_is_waited_for():
    cluster = serving([], isvc=isvc("RevisionFailed", "an older spec's revision failed"))
    with pytest.raises(JobFailed, match=r"^InferenceService 'kdigits' was not Ready within 1s: no status yet$"):
        cluster.wait_inference_service("kdigits", 4, timeout=1)  # the failure is of generation 3
    cluster = serving([], isvc=isvc("RevisionNotReady", 'Revision "kdigits-predictor-00004" is not ready yet.'))
    with pytest.raises(JobFailed, match=r"was not Ready within 1s: Revision \"kdigits-predictor-00004\" is not ready yet\.$"):
        cluster.wait_inference_service("kdigits", 3, timeout=1)
