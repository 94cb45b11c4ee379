"""`make image-smoke`, the push's proof: what a registry's HTTP API (the OCI distribution API, v2)
says of REPOSITORY:TAG, read with the standard library only (it runs on the host's python3).

    registry_check.py HOST:PORT REPOSITORY TAG

Checks that `/v2/REPOSITORY/tags/list` lists TAG and that the manifest's body hashes to the
`Docker-Content-Digest` the registry sends with it, then prints one line, `MANIFEST_DIGEST
CONFIG_DIGEST`: the digest a pull by digest names, and the image's config digest, which is the
image id in every Docker daemon that has it. Exit 1 with one line on stderr where a check fails.
Plain HTTP: only for a registry on 127.0.0.1, as the smoke test runs it."""

from __future__ import annotations

import hashlib
import json
import sys
import urllib.request

# The schema a `docker push` of Docker 20.10 writes; the OCI one for registries that convert.
MANIFEST_TYPES = ("application/vnd.docker.distribution.manifest.v2+json", "application/vnd.oci.image.manifest.v1+json")


def get(url: str, accept: str | None = None) -> tuple[bytes, dict[str, str]]:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read(), dict(response.headers)


def check(registry: str, repository: str, tag: str) -> tuple[str, str]:
    base = f"http://{registry}/v2/{repository}"
    tags = json.loads(get(f"{base}/tags/list")[0])
    if tags.get("name") != repository or tag not in (tags.get("tags") or []):
        raise SystemExit(f"registry_check: {base}/tags/list does not list {tag!r}: {tags}")
    body, headers = get(f"{base}/manifests/{tag}", accept=", ".join(MANIFEST_TYPES))
    digest = headers.get("Docker-Content-Digest", "")
    if digest != "sha256:" + hashlib.sha256(body).hexdigest():
        raise SystemExit(f"registry_check: the manifest of {repository}:{tag} does not hash to its digest {digest!r}")
    manifest = json.loads(body)
    if manifest.get("mediaType", headers.get("Content-Type")) not in MANIFEST_TYPES or not manifest.get("layers"):
        raise SystemExit(f"registry_check: {repository}:{tag} is not a single image manifest with layers: {headers.get('Content-Type')}")
    return digest, manifest["config"]["digest"]


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit("usage: registry_check.py HOST:PORT REPOSITORY TAG")
    print(*check(*sys.argv[1:]))
