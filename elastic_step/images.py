"""The project's container images: one name, so components, Argo templates and worker pods
all default to the same image. `ELASTIC_STEP_IMAGE` overrides it (at compile or render time
for pipelines, at launch time for worker pods)."""

from __future__ import annotations

import os

from elastic_step import __version__

REGISTRY = "ghcr.io/elastic-step"


def default_image(variant: str = "torch") -> str:
    """`ghcr.io/elastic-step/elastic-step-torch:<version>` unless ELASTIC_STEP_IMAGE says otherwise."""
    return os.environ.get("ELASTIC_STEP_IMAGE") or f"{REGISTRY}/elastic-step-{variant}:{__version__}"
