"""The wheels benchmarks/gpu_check.sh needs on a GPU machine that cannot reach a package index.

A GPU machine usually has a Python with a CUDA build of torch and much of the scientific stack,
but not MLflow, FastAPI or pydantic, which a local training job needs (its master tracks to
MLflow and serves the workers over HTTP). This downloads, here, for that machine's Python version
and platform, the project's run-time requirements that a local job imports (pyproject.toml's, less
the cluster's: KFP, Hera, the Kubernetes client, the object stores) with everything they need,
then drops every distribution that machine already has at a version the project accepts (one of
the project's own requirements at a version it does not accept is carried, and shadows it), and
torch and CUDA's libraries whatever: what is left goes in .whl/, which gpu_check.sh installs
beside that Python before it runs.

    python benchmarks/gpu_wheels.py PRESENT [--python-version 3.12] [--out .whl]

PRESENT: that machine's `python3 -m pip list --format=freeze` (or one distribution name a line).
Exit 2, with one line, when PRESENT cannot be read or the wheels would not travel (over
--max-mib)."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib

from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Only a cluster's job imports these (the Kubernetes backend, KFP's and Argo's documents, s3:// and gs:// data).
CLUSTER_ONLY = {"kfp", "kfp-kubernetes", "hera", "kubernetes", "s3fs", "gcsfs"}
# The GPU machine's own, whatever PRESENT says: another torch or CUDA library would replace its CUDA
# build. (nvidia-ml-py, NVML's bindings, is a requirement like any other.)
NEVER_CARRIED = re.compile(r"^(torch|triton|nvidia-(?!ml-py$).*|cuda-.*)$")
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "any"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def present_versions(path: str) -> dict[str, str | None]:
    """Distribution name -> version of a `pip list --format=freeze` (name==version); None where
    the line gives no version (a plain name, a `name @ URL`)."""
    present = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, _, version = line.partition("==")
            present[canonical(re.split(r"[<>@ ;\[]", name, maxsplit=1)[0])] = version.strip() or None
    return present


def unfit(present: dict[str, str | None], requirements: list[str]) -> set[str]:
    """The project's own requirements that machine has at a version they do not accept: carried."""
    wrong = set()
    for text in requirements:
        requirement = Requirement(text)
        name, version = canonical(requirement.name), present.get(canonical(requirement.name))
        if version is not None and not requirement.specifier.contains(version, prereleases=True):
            wrong.add(name)
    return wrong


def local_job_requirements() -> list[str]:
    """pyproject.toml's run-time requirements, less the cluster's and less extras (MLflow's
    [auth] serves a cluster's MLflow, not a job's tracking)."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        requirements = tomllib.load(f)["project"]["dependencies"]
    kept = []
    for requirement in requirements:
        name = canonical(re.split(r"[=<>!~\[ ;]", requirement, maxsplit=1)[0])
        if name not in CLUSTER_ONLY:
            kept.append(re.sub(r"\[[^]]*\]", "", requirement))
    return kept


def download(requirements: list[str], python_version: str, into: str) -> None:
    version = python_version.replace(".", "")
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--python-version", python_version,
               "--implementation", "cp", "--abi", f"cp{version}", "--dest", into,
               "--constraint", os.path.join(ROOT, "constraints.txt")]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    subprocess.run(command + requirements, check=True)


def wheel_name(filename: str) -> str:
    return canonical(filename.split("-", 1)[0])


def to_carry(wheels: list[str], present: dict[str, str | None], requirements: list[str]) -> list[str]:
    """The wheels whose distributions that machine lacks, or has at a version the project's
    requirements refuse; never its torch or CUDA's."""
    replaced = unfit(present, requirements)
    return sorted(f for f in wheels if (wheel_name(f) not in present or wheel_name(f) in replaced)
                  and not NEVER_CARRIED.match(wheel_name(f)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("present", help="the GPU machine's `pip list --format=freeze`, or a name a line")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
    parser.add_argument("--out", default=os.path.join(ROOT, ".whl"), help="where the wheels go (default .whl/)")
    parser.add_argument("--max-mib", type=float, default=56.0,
                        help="refuse a set larger than this (default 56: a device call carries 64 MiB with the tree)")
    args = parser.parse_args()
    try:
        present = present_versions(args.present)
    except OSError as exc:
        print(f"gpu_wheels: cannot read PRESENT {args.present!r} ({exc.strerror}): give the GPU machine's "
              f"`python3 -m pip list --format=freeze` saved in a file", file=sys.stderr)
        return 2
    requirements = local_job_requirements()
    with tempfile.TemporaryDirectory() as fetched:
        download(requirements, args.python_version, fetched)
        carried = to_carry(os.listdir(fetched), present, requirements)
        size = sum(os.path.getsize(os.path.join(fetched, f)) for f in carried) / 2**20
        if size > args.max_mib:
            print(f"gpu_wheels: the {len(carried)} wheels that machine lacks weigh {size:.1f} MiB, over --max-mib "
                  f"{args.max_mib:g}: carry the largest in a call of their own, or raise it", file=sys.stderr)
            return 2
        os.makedirs(args.out, exist_ok=True)
        for stale in os.listdir(args.out):  # one version of each: two would stop the install
            if stale.endswith(".whl"):
                os.remove(os.path.join(args.out, stale))
        for f in carried:
            shutil.copy(os.path.join(fetched, f), args.out)
    print(f"gpu_wheels: {len(carried)} wheels, {size:.1f} MiB, in {args.out} for Python {args.python_version}: "
          + ", ".join(wheel_name(f) for f in carried))
    return 0


if __name__ == "__main__":
    sys.exit(main())
