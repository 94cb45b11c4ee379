"""What goes into the image `make image-smoke` builds, as one digest, so that the Docker tests and
`make cluster CLUSTER_DOCKER=1` never run an image built from older sources than the checkout's.

images/smoke.sh labels the image it builds with the digest of the checkout it built from
(LABEL below); runtime.DockerDaemon.image_state compares that label with the checkout's digest
now. The digest covers what images/Dockerfile copies into the image (the lock, constraints,
pyproject and the package's folders, as .dockerignore lets them through) and the Dockerfile
itself; README.md, which the build copies only as the package's long description, is left out,
so editing the prose does not force a rebuild. Standard library only: smoke.sh runs it with the
system's python3 (`python3 tests/cluster/image_sources.py` prints the torch image's digest, `... --variant tensorflow`
the tensorflow image's)."""

from __future__ import annotations

import hashlib
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LABEL = "org.elastic-step.sources"
SOURCES = ("images/Dockerfile", "images/lock", "constraints.txt", "pyproject.toml",
           "elastic_step", "components", "pipelines", "model_zoo")
SKIPPED = {"__pycache__"}  # .dockerignore's **/__pycache__: never in the image


def source_files(repo: str = REPO) -> list[str]:
    """The paths (relative to `repo`, sorted) whose contents go into the image."""
    found = []
    for source in SOURCES:
        top = os.path.join(repo, source)
        if os.path.isfile(top):
            found.append(source)
        for folder, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if d not in SKIPPED]
            found += [os.path.relpath(os.path.join(folder, name), repo) for name in files]
    return sorted(found)


def digest(repo: str = REPO, variant: str = "torch") -> str:
    """sha256 over each source file's path and contents: any edit, addition, removal or rename changes it.
    Another variant than torch (built from the same files with other build arguments) also hashes its
    name, so one variant's image never passes for another's."""
    total = hashlib.sha256()
    if variant != "torch":
        total.update(f"variant\0{variant}\0".encode())
    for path in source_files(repo):
        with open(os.path.join(repo, path), "rb") as f:
            content = f.read()
        total.update(f"{path}\0{len(content)}\0".encode())
        total.update(content)
    return total.hexdigest()


if __name__ == "__main__":  # image_sources.py [REPO] [--variant VARIANT]
    args = sys.argv[1:]
    variant = args.pop(args.index("--variant") + 1) if "--variant" in args[:-1] else "torch"
    print(digest(next((a for a in args if a != "--variant"), REPO), variant))
