#!/usr/bin/env bash
# Regenerate images/lock/: what each image installs, pinned to constraints.txt's versions, with the
# sha256 of the file pip takes for linux/amd64, CPython 3.11, glibc 2.36 (Debian bookworm, the base
# image's). The Dockerfile installs with --require-hashes: pip refuses a file whose hash the lock
# does not name, and a package it does not list.
#   torch.txt             EXTRAS=torch              (the torch image)
#   torch-tensorflow.txt  EXTRAS=torch,tensorflow   (the tensorflow image)
#   build.txt             setuptools, to build the project itself without fetching anything
# pip resolves each set as the image's build does (`pip install --dry-run --report`) on a machine of
# that platform; run it on one. Needs PyPI. torch is the CPU build: its wheel from TORCH_WHEELS (a
# folder with torch-VERSION+cpu-*.whl, default /opt/wheels) when it holds one, else from
# TORCH_INDEX_URL (default PyTorch's CPU index). A CUDA lock: TORCH_INDEX_URL=.../whl/cu126
# OUT_SUFFIX=-cu126, then build with --build-arg LOCK=images/lock/torch-cu126.txt (the tensorflow
# image also --build-arg EXTRAS_LOCK=images/lock/torch-tensorflow-cu126.txt). pip runs in a
# virtualenv of its own; the project's is not touched.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_WHEELS=${TORCH_WHEELS:-/opt/wheels}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
OUT_SUFFIX=${OUT_SUFFIX:-}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= PIP_DISABLE_PIP_VERSION_CHECK=1

python3 -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q --upgrade "pip>=25"
git archive --format=tar HEAD | tar -x -C "$WORK" --one-top-level=src   # the committed sources
cp constraints.txt pyproject.toml "$WORK/src/"                          # with the constraints as they are now
if [ -z "$OUT_SUFFIX" ] && ls "$TORCH_WHEELS"/torch-*+cpu-*.whl >/dev/null 2>&1; then
  torch_source=(--find-links "$TORCH_WHEELS")   # the CPU wheel at hand: the hash is the file's own
else
  torch_source=(--extra-index-url "$TORCH_INDEX_URL")
fi

lock() {  # OUT REQUIREMENT [pip options]: resolve REQUIREMENT as a fresh install and write its lock
  local out=$1 requirement=$2; shift 2
  (cd "$WORK/src" && "$WORK/venv/bin/pip" install --dry-run --ignore-installed --quiet --report "$WORK/report.json" \
     -c constraints.txt "$@" "$requirement")
  "$WORK/venv/bin/python" - "$WORK/report.json" "$out" "$requirement" <<'PY'
import json, sys
report, out, requirement = sys.argv[1:]
lines = [f"# {requirement} for linux/amd64, CPython 3.11: made by images/lock.sh from constraints.txt; do not edit.\n"]
for item in sorted(json.load(open(report))["install"], key=lambda i: i["metadata"]["name"].lower()):
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    if item["download_info"]["url"].startswith("file:") and "archive_info" not in item["download_info"]:
        continue  # the project itself, installed from its source by the Dockerfile
    digest = item["download_info"]["archive_info"]["hashes"]["sha256"]
    lines.append(f"{name}=={version} \\\n    --hash=sha256:{digest}\n")
open(out, "w").write("".join(lines))
PY
  echo "lock: wrote $out ($(grep -c '==' "$out") packages)"
}
mkdir -p images/lock
lock "$PWD/images/lock/torch$OUT_SUFFIX.txt" ".[torch]" "${torch_source[@]}"
lock "$PWD/images/lock/torch-tensorflow$OUT_SUFFIX.txt" ".[torch,tensorflow]" "${torch_source[@]}"
lock "$PWD/images/lock/build.txt" "setuptools>=68"
