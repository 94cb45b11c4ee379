"""The `mlflow` target's rollout over two Deployments behind one Service: the new version starts
as the `canary` track beside `stable` (its share of the Ready endpoints is its share of the
traffic); once Ready it replaces `stable` and the canary goes. If it never becomes Ready the
canary is deleted, so the traffic is all `stable`'s again, and the deploy fails with the reason."""

from __future__ import annotations

from elastic_step.errors import ConfigError, JobFailed
from elastic_step.release.deploy import DeployResult, _endpoint, failed, render_objects
from elastic_step.release.deploy_render import DeploySettings, Target, Track, model_deployment, model_service
from elastic_step.release.served_model import ServedModel, resolve


def apply_mlflow(cluster, registered_model: str, model: ServedModel | None, settings: DeploySettings, timeout: float,
                 mlflow_uri: str | None) -> DeployResult:
    served = cluster.served_version(settings.name)
    endpoint = _endpoint(Target.MLFLOW, settings)
    if model is None:  # --rollback: stable back to the version it replaced
        if served is None or not served[1]:
            raise ConfigError(f"{settings.namespace}/{settings.name} has no previous revision to roll back to")
        model = resolve(registered_model, served[1], mlflow_uri)
        return _to_stable(cluster, model, settings, timeout, endpoint, previous=served[0])
    if served is None:  # the first deploy: nothing to keep serving meanwhile
        for obj in render_objects(model, Target.MLFLOW, settings, canary=False):
            cluster.write(obj)
        try:
            cluster.wait_deployment(settings.name, Track.STABLE, timeout)
        except JobFailed as exc:
            raise failed(str(exc), "") from None
        return DeployResult(Target.MLFLOW, settings.name, settings.namespace, model.version, endpoint, applied=True)
    cluster.write(model_deployment(model, settings, Track.CANARY))  # the Service keeps naming what stable serves
    try:
        cluster.wait_deployment(settings.name, Track.CANARY, timeout)
    except JobFailed as exc:
        cluster.delete_deployment(settings.name, Track.CANARY)
        raise failed(str(exc), served[0]) from None
    return _to_stable(cluster, model, settings, timeout, endpoint, previous=served[0])


def _to_stable(cluster, model: ServedModel, settings: DeploySettings, timeout: float, endpoint: str, previous: str):
    cluster.write(model_deployment(model, settings, Track.STABLE, previous_version=previous))
    cluster.write(model_service(model, settings))
    cluster.wait_deployment(settings.name, Track.STABLE, timeout)
    cluster.delete_deployment(settings.name, Track.CANARY)
    return DeployResult(Target.MLFLOW, settings.name, settings.namespace, model.version, endpoint, previous, applied=True)
