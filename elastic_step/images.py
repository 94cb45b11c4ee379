"""The project's container images, named in one place: the Makefile builds and pushes these names,
`make compile` and `elastic-step argo render` write them into the shipped YAML, deploy/'s
kustomization points at them, and worker pods default to them. A name is
`REGISTRY/elastic-step-VARIANT:VERSION`; VERSION is the package's own, so shipped YAML and the
wheel never disagree. `ELASTIC_STEP_IMAGE` overrides the whole name (at compile or render time for
pipelines, at launch time for worker pods). The image runs as `IMAGE_USER`, never root."""

from __future__ import annotations

import os
import re

from elastic_step import __version__

# The registry the shipped files name (the Makefile's IMAGE_REGISTRY default; a test keeps them equal).
REGISTRY = "ghcr.io/elastic-step"
# What `make images` builds: the torch image (the default everywhere), and one that adds TensorFlow.
VARIANTS = ("torch", "tensorflow")
# The uid and gid of the image's user (images/Dockerfile's `USER 1000:1000`).
IMAGE_USER = 1000

# A registry host (with an optional port) and path, as Docker's reference grammar allows them.
_REGISTRY = re.compile(r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:[0-9]{1,5})?(/[a-z0-9]+([._-]+[a-z0-9]+)*)*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


class ImageNameError(ValueError):
    """A registry, version or variant that cannot make an image name."""


def image_name(variant: str = "torch", registry: str = REGISTRY, version: str = __version__) -> str:
    """`REGISTRY/elastic-step-VARIANT:VERSION`, each part checked (the error names the part)."""
    if variant not in VARIANTS:
        raise ImageNameError(f"image variant {variant!r} is not one of {', '.join(VARIANTS)}")
    registry = registry.rstrip("/")
    if not _REGISTRY.match(registry):
        raise ImageNameError(f"image registry {registry!r} is not a registry and path (e.g. registry.example.com/team)")
    if not _TAG.match(version):
        raise ImageNameError(f"image version {version!r} is not an image tag (letters, digits, '_', '.', '-')")
    return f"{registry}/elastic-step-{variant}:{version}"


def default_image(variant: str = "torch") -> str:
    """`ghcr.io/elastic-step/elastic-step-torch:<version>` unless ELASTIC_STEP_IMAGE says otherwise."""
    return os.environ.get("ELASTIC_STEP_IMAGE") or image_name(variant)


def chosen_image(image: str | None = None, registry: str | None = None, version: str | None = None,
                 variant: str = "torch") -> str:
    """The image a compile or render writes: `image` as given, else the variant's name in `registry`
    at `version` (each defaulting to the package's), else `default_image()`."""
    if image and (registry or version):
        raise ImageNameError("give either an image or a registry and version, not both")
    if image:
        return image
    if registry or version:
        return image_name(variant, registry or REGISTRY, version or __version__)
    return default_image(variant)

