"""`deploy_model`: a registered version served on a cluster, resolved through the registry (no
storage URI typed by anyone), as a KServe InferenceService or a plain Deployment of MLflow's
model server, with a canary when a previous revision serves and a rollback when the new one
does not become Ready. Every input is checked before anything is written."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from elastic_step.errors import ConfigError, JobFailed
from elastic_step.release import deploy_render as render
from elastic_step.release.deploy_render import DeploySettings, Target, Track
from elastic_step.release.served_model import ServedModel, resolve

log = logging.getLogger("elastic_step.release")


@dataclass
class DeployResult:
    target: Target
    name: str
    namespace: str
    version: str
    endpoint: str
    previous_version: str = ""
    objects: list[dict] = field(default_factory=list)
    applied: bool = False

    def describe(self) -> str:
        before = f" (previous: version {self.previous_version})" if self.previous_version else ""
        verb = "serves" if self.applied else "would serve"
        return f"{self.target.value} {self.namespace}/{self.name} {verb} version {self.version}{before} at {self.endpoint}"


def check_inputs(*, alias: str, version: str, target: str, canary_percent: int, timeout: float, rollback: bool) -> Target:
    """The inputs that need no registry nor cluster, each a one-line ConfigError."""
    if rollback and (alias or version):
        raise ConfigError("--rollback returns to the previous revision; give no --alias or --version with it")
    if not rollback and bool(alias) == bool(version):
        raise ConfigError("give exactly one of --alias (e.g. champion) or --version (export_model's model_version)")
    if target not in {t.value for t in Target}:
        raise ConfigError(f"--target {target!r} is not one of {', '.join(t.value for t in Target)}")
    if not 0 < canary_percent < 100:
        raise ConfigError(f"--canary-percent {canary_percent} is not between 1 and 99")
    if timeout <= 0:
        raise ConfigError(f"--timeout {timeout} must be positive (seconds to wait for Ready)")
    return Target(target)


def render_objects(model: ServedModel, target: Target, settings: DeploySettings, canary: bool,
                   previous_version: str = "") -> list[dict]:
    """What a first deploy (canary False) or a canary (True) writes, in the order it is written."""
    if target is Target.KSERVE:
        return [render.inference_service(model, settings, canary, previous_version)]
    track = Track.CANARY if canary else Track.STABLE
    return [render.model_service(model, settings), render.model_deployment(model, settings, track, previous_version)]


def deploy_model(*, registered_model: str, settings: DeploySettings, alias: str = "", version: str = "",
                 target: str = "mlflow", timeout: float = 300.0, rollback: bool = False, dry_run: bool = False,
                 mlflow_uri: str | None = None, api_client=None) -> DeployResult:
    """Deploy (or, with `rollback`, return to the previous revision). `dry_run`: resolve and
    render only, as a first deploy; nothing is read from or written to a cluster."""
    kind = check_inputs(alias=alias, version=version, target=target, canary_percent=settings.canary_percent,
                        timeout=timeout, rollback=rollback)
    model = None if rollback else resolve(registered_model, version or alias, mlflow_uri)
    if dry_run:
        if model is None:
            raise ConfigError("--dry-run renders a version; a rollback reads the cluster, so give no --dry-run with it")
        return DeployResult(kind, settings.name, settings.namespace, model.version, _endpoint(kind, settings),
                            objects=render_objects(model, kind, settings, canary=False))
    from elastic_step.release.deploy_apply import ServingCluster

    cluster = ServingCluster(api_client or _api_client(), settings.namespace)
    cluster.preflight(kind, settings)
    if kind is Target.KSERVE:
        from elastic_step.release.deploy_kserve import apply_kserve

        return apply_kserve(cluster, registered_model, model, settings, timeout, mlflow_uri)
    from elastic_step.release.deploy_mlflow import apply_mlflow

    return apply_mlflow(cluster, registered_model, model, settings, timeout, mlflow_uri)


def _endpoint(target: Target, settings: DeploySettings) -> str:
    if target is Target.KSERVE:  # KServe's own URL is in status.url once Ready
        return f"http://{settings.name}.{settings.namespace}.svc.cluster.local"
    return f"http://{settings.name}.{settings.namespace}.svc.cluster.local/invocations"


def _api_client():
    from elastic_step.backends.kubernetes.client import _api_client_class, load_configuration

    try:
        return _api_client_class()(load_configuration())
    except ConfigError:
        raise ConfigError("no cluster to deploy to: set KUBECONFIG, run in a pod with a service account, or "
                          "see the objects with --dry-run") from None


def failed(reason: str, rolled_back_to: str) -> JobFailed:
    back = f"; traffic stays on version {rolled_back_to}" if rolled_back_to else "; no previous revision to return to"
    return JobFailed(reason + back)
