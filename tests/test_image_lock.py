"""The images install what a lock names, and nothing else: images/lock/ (made from
constraints.txt by images/lock.sh) pins every package of each variant with the sha256 of every file
pip may take, the Dockerfile installs with `--require-hashes`, and its base image is pinned by
digest. Checked here without a network: each lock agrees with constraints.txt, gives every pin a
hash, and covers every distribution the variant's requirements reach (walked through this
environment's installed metadata, where constraints.txt put the same versions). The build itself
(`pip install --require-hashes` against PyPI) runs in `make image-smoke`."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
LOCKS = {"torch": ("torch",), "torch-tensorflow": ("torch", "tensorflow")}
PIN = re.compile(r"^([A-Za-z0-9._-]+)==([^\s\\;]+)")


def pins(path: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes) of a pip-compile lock (continuation lines joined)."""
    text = path.read_text().replace("\\\n", " ")
    found = {}
    for line in text.splitlines():
        match = PIN.match(line.strip())
        if match:
            found[canonicalize_name(match.group(1))] = (match.group(2), re.findall(r"--hash=sha256:([0-9a-f]{64})", line))
    return found


def constraints() -> dict[str, str]:
    pinned = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        match = PIN.match(line.split("#")[0].strip())
        if match:
            pinned[canonicalize_name(match.group(1))] = match.group(2)
    return pinned


def needed(extras: tuple[str, ...]) -> set[str]:
    """Every distribution `elastic-step[extras]` reaches, by this environment's metadata."""
    environment = default_environment()
    todo = [(canonicalize_name("elastic-step"), frozenset(extras))]
    seen: set[str] = set()
    while todo:
        name, wanted = todo.pop()
        if (name, wanted) in seen:
            continue
        seen.add((name, wanted))
        for text in metadata.requires(name) or []:
            requirement = Requirement(text)
            if requirement.marker is None or any(requirement.marker.evaluate({**environment, "extra": e})
                                                 for e in (wanted or {""})):
                todo.append((canonicalize_name(requirement.name), frozenset(requirement.extras)))
    return {name for name, _ in seen} - {"elastic-step"}


@pytest.mark.parametrize("lock, extras", list(LOCKS.items()))
def test_each_lock_pins_what_constraints_pins_with_a_hash_for_every_package(lock, extras):
    locked = pins(ROOT / "images" / "lock" / f"{lock}.txt")
    assert locked and all(hashes for _, hashes in locked.values()), [n for n, (_, h) in locked.items() if not h]
    pinned = constraints()
    differ = {name: (version, pinned[name]) for name, (version, _) in locked.items()
              if name in pinned and version.split("+")[0] != pinned[name].split("+")[0]}
    assert differ == {}, f"lock and constraints.txt disagree (run images/lock.sh): {differ}"


@pytest.mark.parametrize("lock, extras", list(LOCKS.items()))
def test_each_lock_covers_everything_its_variant_needs(lock, extras):
    missing = needed(extras) - set(pins(ROOT / "images" / "lock" / f"{lock}.txt"))
    assert missing == set(), f"{lock}.txt lacks {sorted(missing)} (run images/lock.sh)"


@pytest.mark.parametrize("lock", [name for name in LOCKS if name != "torch"])
def test_a_variant_lock_adds_to_the_torch_lock_without_changing_a_pin_or_hash(lock):
    """The tensorflow image installs its lock on top of the torch image's environment: a package both
    name at other versions or hashes would be reinstalled over the shared layer, or refused."""
    torch, variant = pins(ROOT / "images" / "lock" / "torch.txt"), pins(ROOT / "images" / "lock" / f"{lock}.txt")
    changed = {name: (pinned, variant.get(name)) for name, pinned in torch.items() if variant.get(name) != pinned}
    assert changed == {}, f"{lock}.txt changes the torch lock's pins (run images/lock.sh): {changed}"
    assert {"tensorflow-cpu", "keras"} <= set(variant) - set(torch)


def test_the_torch_lock_takes_the_cpu_build_and_the_build_lock_has_setuptools():
    assert pins(ROOT / "images" / "lock" / "torch.txt")["torch"][0].endswith("+cpu")
    assert "setuptools" in pins(ROOT / "images" / "lock" / "build.txt")


def test_the_dockerfile_pins_its_base_by_digest_and_installs_only_hashed_files():
    dockerfile = (ROOT / "images" / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim-bookworm@sha256:[0-9a-f]{64}$", dockerfile, re.M)
    commands = " ".join(line for line in dockerfile.replace("\\\n", " ").splitlines() if not line.lstrip().startswith("#"))
    installs = [re.split(r"&&|;", part)[0] for part in commands.split("pip install")[1:]]
    assert len(installs) == 4 and all("--require-hashes" in i or "--no-index" in i for i in installs), installs
    # The variant's own step comes after everything the variants share (the torch venv copied in, the
    # user): EXTRAS is declared nowhere before it, so its value cannot change the shared layers' cache.
    final = commands[commands.rindex(" FROM "):]
    assert "ARG EXTRAS" not in commands[:commands.rindex(" FROM ")]
    assert final.index("COPY --from=build /opt/venv") < final.index("useradd") < final.index("ARG EXTRAS=torch")
    # The build context (everything else excluded) carries the locks.
    assert "!images/lock" in (ROOT / ".dockerignore").read_text().splitlines()
