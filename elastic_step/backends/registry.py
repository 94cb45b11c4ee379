"""Chooses a backend by name."""

from __future__ import annotations

from elastic_step.backends.api import Backend, LaunchSpec
from elastic_step.errors import ConfigError

BACKENDS = ("local", "kubernetes")


def create_backend(name: str, spec: LaunchSpec, config=None, **options) -> Backend:
    """`config` (a TrainConfig) carries the settings of backends that have any (kubernetes)."""
    if name == "local":
        from elastic_step.backends.local import LocalBackend

        return LocalBackend(spec, **options)
    if name == "kubernetes":
        from elastic_step.backends.kubernetes.backend import KubernetesBackend
        from elastic_step.backends.kubernetes.options import settings_from_config

        if config is None:
            raise ConfigError("the kubernetes backend needs the job's settings (create_backend(..., config=...))")
        from elastic_step.backends.kubernetes.manifests import cluster_job_name
        from elastic_step.tracking.run import pipeline_run_id

        name = cluster_job_name(config.job_name, pipeline_run_id(config.pipeline_run_id))
        return KubernetesBackend(spec, settings_from_config(config), name, **options)
    raise ConfigError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")
