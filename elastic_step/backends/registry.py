"""Chooses a backend by name."""

from __future__ import annotations

from elastic_step.backends.api import Backend, LaunchSpec
from elastic_step.errors import ConfigError

BACKENDS = ("local",)


def create_backend(name: str, spec: LaunchSpec, **options) -> Backend:
    if name == "local":
        from elastic_step.backends.local import LocalBackend

        return LocalBackend(spec, **options)
    raise ConfigError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")
