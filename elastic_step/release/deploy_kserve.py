"""The `kserve` target's rollout: a canary at --canary-percent when a previous revision serves,
promoted to all traffic once Ready; on failure all traffic back to the last rolled-out revision
(KServe v1beta1: canaryTrafficPercent 0), and the deploy fails with KServe's reason."""

from __future__ import annotations

from elastic_step.errors import ConfigError, JobFailed
from elastic_step.release.deploy import DeployResult, failed, render_objects
from elastic_step.release.deploy_render import PREVIOUS_VERSION_ANNOTATION, SERVED_VERSION_ANNOTATION, DeploySettings, Target
from elastic_step.release.served_model import ServedModel, resolve


def apply_kserve(cluster, registered_model: str, model: ServedModel | None, settings: DeploySettings, timeout: float,
                 mlflow_uri: str | None) -> DeployResult:
    existing = cluster.inference_service(settings.name)
    previous = _rolled_out_version(existing)
    # what a rollback returns to while the rolled-out revision serves: kept if this rollout fails
    replaced = (existing or {}).get("metadata", {}).get("annotations", {}).get(PREVIOUS_VERSION_ANNOTATION) or None
    if model is None:  # --rollback: the version this one replaced, rolled out again as a new revision
        # (canaryTrafficPercent 0 only returns to the last rolled-out revision, which after a
        # completed rollout is the current one: KServe's ksvc reconciler)
        if not replaced:
            raise ConfigError(f"InferenceService {settings.namespace}/{settings.name} has no previous revision to roll back to")
        model = resolve(registered_model, replaced, mlflow_uri)
    (obj,) = render_objects(model, Target.KSERVE, settings, canary=bool(previous), previous_version=previous)
    written = cluster.write_inference_service(obj, existing)
    try:
        url = cluster.wait_inference_service(settings.name, written["metadata"].get("generation", 1), timeout)
        if previous:  # the canary is Ready: it takes all the traffic
            promoted = dict(written, spec={"predictor": {**written["spec"]["predictor"], "canaryTrafficPercent": 100}})
            written = cluster.write_inference_service(promoted, cluster.inference_service(settings.name))
            url = cluster.wait_inference_service(settings.name, written["metadata"].get("generation", 1), timeout)
    except JobFailed as exc:
        if previous:
            cluster.roll_back_inference_service(settings.name, {PREVIOUS_VERSION_ANNOTATION: replaced})
        raise failed(str(exc), previous) from None
    cluster.mark_served(settings.name, model.version)
    return DeployResult(Target.KSERVE, settings.name, settings.namespace, model.version, url, previous, [obj], True)


def _rolled_out_version(existing: dict | None) -> str:
    """The version whose revision KServe has rolled out ("" when none is): after a canary that
    failed and was rolled back, the previous one, whatever the spec's labels say."""
    if not existing or not existing.get("status", {}).get("components", {}).get("predictor", {}).get("latestRolledoutRevision"):
        return ""
    return existing["metadata"].get("annotations", {}).get(SERVED_VERSION_ANNOTATION, "")


def _previous_revision(existing: dict) -> str:
    predictor = existing.get("status", {}).get("components", {}).get("predictor", {})
    return predictor.get("previousRolledoutRevision", "")
