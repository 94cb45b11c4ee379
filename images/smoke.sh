#!/usr/bin/env bash
# `make image-smoke`: build the torch image for real and train in it, on a machine without a
# container registry. Starts its own Docker daemon (no bridge, no iptables: --network host is the
# only network), makes the base image with debootstrap + docker import, serves the local CPU
# torch wheel to pip, builds, runs a container that trains digits with 2 workers and one
# SIGKILL, and cleans up (daemon stopped by pid, its netns mount removed). Where no Docker
# engine can be started it says so and exits 0 without claiming success.
set -euo pipefail
cd "$(dirname "$0")/.."

WORK=${IMAGE_SMOKE_DIR:-$PWD/build/image-smoke}
VERSION=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' elastic_step/__init__.py)
IMAGE=ghcr.io/elastic-step/elastic-step-torch:$VERSION
BASE=elastic-step-base:bookworm
SOCK=$WORK/docker.sock
export DOCKER_HOST=unix://$SOCK

skip() { echo "image-smoke: SKIPPED, no image was built or run: $*"; exit 0; }

[ "$(id -u)" = 0 ] || skip "needs root to start its own Docker daemon"
command -v dockerd >/dev/null && command -v docker >/dev/null || skip "no dockerd/docker (apt-get install docker.io; .ci/run installs it)"
command -v debootstrap >/dev/null || skip "no debootstrap (apt-get install debootstrap; .ci/run installs it)"
WHEEL=$(ls /opt/wheels/torch-2.13.0*.whl 2>/dev/null | head -1 || true)
[ -n "$WHEEL" ] || WHEEL=$(find / -xdev -name 'torch-2.13.0*cpu*.whl' 2>/dev/null | head -1 || true)
[ -n "$WHEEL" ] || skip "no local CPU torch 2.13.0 wheel to serve (an unpinned resolve would pull the CUDA build)"
# A daemon already on this folder (`make cluster CLUSTER_DOCKER=1`, a Docker test): a second would take
# its socket and, stopping, unmount its data root. Checked before the cleanup below is armed.
if OTHER=$(cat "$WORK/dockerd.pid" 2>/dev/null) && [ "$(cat "/proc/$OTHER/comm" 2>/dev/null)" = dockerd ]; then
  echo "image-smoke: FAILED: a Docker daemon already runs on $WORK (pid $OTHER): stop it first (make cluster-stop, else kill $OTHER), or set IMAGE_SMOKE_DIR to another folder"; exit 1
fi

mkdir -p "$WORK"
started=$(date +%s)
DOCKERD_PID= HTTP_PID=
cleanup() {
  [ -n "$HTTP_PID" ] && kill "$HTTP_PID" 2>/dev/null || true
  if [ -n "$DOCKERD_PID" ]; then
    kill "$DOCKERD_PID" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.2; done
  fi
  mountpoint -q "$WORK/exec/netns/default" 2>/dev/null && umount "$WORK/exec/netns/default" || true
  # dockerd bind-mounts its data-root onto itself; a daemon that was killed leaves that behind.
  mountpoint -q "$WORK/data" 2>/dev/null && umount "$WORK/data" || true
  echo "image-smoke: cleaned up (daemon stopped, mounts removed); $(( $(date +%s) - started ))s in all"
}
trap cleanup EXIT

dockerd --bridge=none --iptables=false --data-root "$WORK/data" --exec-root "$WORK/exec" \
  --pidfile "$WORK/dockerd.pid" -H "unix://$SOCK" >"$WORK/dockerd.log" 2>&1 &
DOCKERD_PID=$!
for _ in $(seq 150); do docker version >/dev/null 2>&1 && break; kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.2; done
docker version >/dev/null 2>&1 || { tail -5 "$WORK/dockerd.log"; skip "the Docker daemon did not start (see $WORK/dockerd.log)"; }

if ! docker image inspect "$BASE" >/dev/null 2>&1; then
  t=$(date +%s)
  rm -rf "$WORK/rootfs"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$WORK/rootfs" >"$WORK/debootstrap.log" 2>&1 \
    || { tail -5 "$WORK/debootstrap.log"; echo "image-smoke: FAILED: debootstrap"; exit 1; }
  cp /etc/ssl/certs/ca-certificates.crt "$WORK/rootfs/etc/ssl/certs/ca-certificates.crt"  # pip's HTTPS, as the host trusts it
  tar -C "$WORK/rootfs" -c . | docker import - "$BASE" >/dev/null
  rm -rf "$WORK/rootfs"
  echo "image-smoke: base image $BASE made in $(( $(date +%s) - t ))s"
fi

PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
python3 -m http.server --bind 127.0.0.1 --directory "$(dirname "$WHEEL")" "$PORT" >/dev/null 2>&1 &
HTTP_PID=$!

t=$(date +%s)
# Labelled with the digest of what goes into it: the cluster tests and `make cluster` reuse it only while that matches.
DOCKER_BUILDKIT=0 docker build --network host -f images/Dockerfile -t "$IMAGE" --label "org.elastic-step.sources=$(python3 tests/cluster/image_sources.py)" \
  --build-arg BASE_IMAGE="$BASE" --build-arg PIP_FIND_LINKS="http://127.0.0.1:$PORT/" --build-arg TORCH_INDEX_URL= . >"$WORK/build.log" 2>&1 \
  || { tail -30 "$WORK/build.log"; echo "image-smoke: FAILED: docker build (log: $WORK/build.log)"; exit 1; }
grep "^imports ok" "$WORK/build.log" || true
echo "image-smoke: built $IMAGE in $(( $(date +%s) - t ))s ($(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))"

[ "$(docker image inspect -f '{{.Config.User}}' "$IMAGE")" = "1000:1000" ] || { echo "image-smoke: FAILED: image does not run as the non-root user"; exit 1; }
t=$(date +%s)
docker run --rm --network host -v "$PWD/images/smoke_job.py:/smoke_job.py:ro" --entrypoint python "$IMAGE" /smoke_job.py \
  >"$WORK/run.log" 2>&1 || { tail -30 "$WORK/run.log"; echo "image-smoke: FAILED: the training run in the image"; exit 1; }
grep '^smoke:' "$WORK/run.log"
echo "image-smoke: PASSED: trained in the image in $(( $(date +%s) - t ))s"

# The compiled training pipeline under KFP's own DockerRunner, each component in the image.
t=$(date +%s)
.venv/bin/python images/kfp_docker_run.py >"$WORK/kfp-docker.log" 2>&1 \
  || { tail -40 "$WORK/kfp-docker.log"; echo "image-smoke: FAILED: the compiled pipeline under kfp.local.DockerRunner (log: $WORK/kfp-docker.log)"; exit 1; }
grep '^kfp-docker:' "$WORK/kfp-docker.log"
