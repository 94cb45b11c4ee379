#!/usr/bin/env bash
# `make image-smoke`: build both images (torch, tensorflow) for real and train in each, on a machine
# with no registry to pull from. Starts its own Docker daemon (no bridge, no iptables: --network host is the
# only network), makes the base image with debootstrap + docker import, serves the local CPU
# torch wheel to pip, builds, runs a container that trains digits with 2 workers and one
# SIGKILL, runs the compiled pipeline under kfp.local.DockerRunner, builds the tensorflow image
# on the torch image's layers and trains the Keras digits model in it (2 workers, exact audit),
# pushes both images with `make push` to a registry it serves on 127.0.0.1 and pulls them back into
# a fresh daemon, and cleans up
# (daemons and registry stopped by pid, their netns mounts removed). Where no Docker engine can be
# started it says so and exits 0 without claiming success.
set -euo pipefail
cd "$(dirname "$0")/.."

WORK=${IMAGE_SMOKE_DIR:-$PWD/build/image-smoke}
VERSION=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' elastic_step/__init__.py)
IMAGE=ghcr.io/elastic-step/elastic-step-torch:$VERSION
IMAGE_TF=ghcr.io/elastic-step/elastic-step-tensorflow:$VERSION
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
DOCKERD_PID= HTTP_PID= REGISTRY_PID= FRESH_PID=
FRESH=$WORK/fresh  # the pull's second daemon: its own data and exec roots, removed at the end
stop_daemon() {  # PID ROOT: stop that dockerd by its pid and remove what it left mounted under ROOT
  if [ -n "$1" ]; then
    kill "$1" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$1" 2>/dev/null || break; sleep 0.2; done
  fi
  mountpoint -q "$2/exec/netns/default" 2>/dev/null && umount "$2/exec/netns/default" || true
  # dockerd bind-mounts its data-root onto itself; a daemon that was killed leaves that behind.
  mountpoint -q "$2/data" 2>/dev/null && umount "$2/data" || true
}
cleanup() {
  [ -n "$HTTP_PID" ] && kill "$HTTP_PID" 2>/dev/null || true
  [ -n "$REGISTRY_PID" ] && kill "$REGISTRY_PID" 2>/dev/null || true
  rm -rf "$WORK/registry"
  if [ -n "$FRESH_PID" ]; then stop_daemon "$FRESH_PID" "$FRESH"; rm -rf "$FRESH"; fi
  stop_daemon "$DOCKERD_PID" "$WORK"
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

# Both images built, the registry's copy and the fresh daemon's pull took at most 15 GB here
# (sampled every 20 s; with the previous run's images still in the data root); short of that
# it fails now, in one line, rather than as "no space left on device" deep inside a docker build.
FREE_GB_NEEDED=${IMAGE_SMOKE_FREE_GB:-15}
free_gb=$(df -P -B1G "$WORK" | awk 'NR == 2 {print $4}')
if [ "$free_gb" -lt "$FREE_GB_NEEDED" ] && ! docker image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "image-smoke: FAILED: $free_gb GB free on the disk of $WORK, a fresh build needs about $FREE_GB_NEEDED GB: free some (rm -rf $WORK once no daemon uses it) or set IMAGE_SMOKE_DIR to a folder on a larger disk"; exit 1
fi

# The wheel server's URL is a build argument, and Docker's build cache keys every RUN on the build
# arguments: a new port each run would rebuild the whole environment (minutes) every time. So the
# port is fixed per folder, outside the kernel's ephemeral range; only if it is taken, another.
PORT=$(python3 - "$WORK" <<'PY'
import hashlib, socket, sys
stable = 20000 + int(hashlib.sha256(sys.argv[1].encode()).hexdigest(), 16) % 10000
for port in (stable, 0):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        print(f"image-smoke: port {stable} is taken: the wheel server takes another, and the build reuses no cached environment", file=sys.stderr)
        continue
    print(s.getsockname()[1])
    break
PY
)
python3 -m http.server --bind 127.0.0.1 --directory "$(dirname "$WHEEL")" "$PORT" >/dev/null 2>&1 &
HTTP_PID=$!

# Labelled with the digest of what goes into it: the cluster tests and `make cluster` reuse it only while that matches.
build() {  # VARIANT EXTRAS IMAGE LOG
  DOCKER_BUILDKIT=0 docker build --network host -f images/Dockerfile -t "$3" --label "org.elastic-step.sources=$(python3 tests/cluster/image_sources.py --variant "$1")" \
    --build-arg EXTRAS="$2" --build-arg BASE_IMAGE="$BASE" --build-arg PIP_FIND_LINKS="http://127.0.0.1:$PORT/" --build-arg TORCH_INDEX_URL= . >"$4" 2>&1
}
# runc can fail to start a build step's container on a loaded machine ("can't get final child's PID
# from pipe"): that one failure is retried once, from the layers already built; any other fails.
build_image() {  # VARIANT EXTRAS IMAGE LOG
  local replaced
  replaced=$(docker image inspect -f '{{.Id}}' "$3" 2>/dev/null || true)
  if ! build "$@"; then
    grep -q "OCI runtime create failed" "$4" || { tail -30 "$4"; echo "image-smoke: FAILED: docker build of the $1 image (log: $4)"; exit 1; }
    echo "image-smoke: a build step's container did not start ($(grep -m1 -o "OCI runtime create failed.*" "$4" | cut -c1-160)); building again"
    build "$@" || { tail -30 "$4"; echo "image-smoke: FAILED: docker build of the $1 image (log: $4)"; exit 1; }
  fi
  [ "$(docker image inspect -f '{{.Config.User}}' "$3")" = "1000:1000" ] || { echo "image-smoke: FAILED: the $1 image does not run as the non-root user"; exit 1; }
  # The image this tag named before, now untagged, is removed with the layers only it used: run after
  # run they would pile up in the data root until the disk is full. (Not `docker image prune`: that
  # would also drop the build stage's cache, which the other variant and the next build reuse.)
  # Its other names (the push's, below) go with it.
  if [ -n "$replaced" ] && [ "$replaced" != "$(docker image inspect -f '{{.Id}}' "$3")" ]; then
    for name in $(docker image inspect -f '{{join .RepoTags " "}}' "$replaced") "$replaced"; do
      docker rmi "$name" >/dev/null 2>&1 || true
    done
    if docker image inspect "$replaced" >/dev/null 2>&1; then
      echo "image-smoke: the replaced $1 image $replaced is still in use (a container of it?); left in place"
    fi
  fi
}
t=$(date +%s)
build_image torch torch "$IMAGE" "$WORK/build.log"
grep "^imports ok" "$WORK/build.log" || true
echo "image-smoke: built $IMAGE in $(( $(date +%s) - t ))s ($(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))"

# IMAGE_SMOKE_STEPS=build: the torch image only, for the Docker tests of `make test`, which run their own
# jobs in it; `make image-smoke` (which CI runs before `make test`) runs every check below.
if [ "${IMAGE_SMOKE_STEPS:-all}" = build ]; then
  echo "image-smoke: built only (IMAGE_SMOKE_STEPS=build): the training run, the DockerRunner pipeline, the tensorflow image and the push were not tried"; exit 0
fi
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

# The tensorflow image: the torch image's layers plus TensorFlow and Keras from their lock (the
# Dockerfile's last variant step), then a Keras job in it: 2 workers, 1 epoch, an exact audit.
t=$(date +%s)
build_image tensorflow torch,tensorflow "$IMAGE_TF" "$WORK/build-tensorflow.log"
grep -ao "tensorflow [0-9.]* keras [0-9.]*" "$WORK/build-tensorflow.log" || true  # TensorFlow's log may put escapes before it
shared=$(python3 -c 'import sys; a, b = (set(l.split()) for l in sys.argv[1:]); print(len(a & b), len(b))' \
  "$(docker image inspect -f '{{join .RootFS.Layers " "}}' "$IMAGE")" "$(docker image inspect -f '{{join .RootFS.Layers " "}}' "$IMAGE_TF")")
echo "image-smoke: built $IMAGE_TF in $(( $(date +%s) - t ))s ($(docker image inspect -f '{{.Size}}' "$IMAGE_TF" | awk '{printf "%.0f MB", $1/1e6}'), layers shared with the torch image: ${shared% *} of ${shared#* })"
# Everything up to the variant's own step (the base, the environment, the user, the locks) is the
# torch image's: fewer shared layers means the build did not reuse them and a registry gets a second
# copy of the environment.
[ "${shared% *}" -ge 4 ] || { echo "image-smoke: FAILED: the tensorflow image shares only ${shared% *} layers with the torch image, not the 4 before its own step: the build did not reuse the torch image's (see $WORK/build-tensorflow.log)"; exit 1; }
t=$(date +%s)
docker run --rm --network host -v "$PWD/images/smoke_keras_job.py:/smoke_keras_job.py:ro" --entrypoint python "$IMAGE_TF" /smoke_keras_job.py \
  >"$WORK/run-tensorflow.log" 2>&1 || { tail -30 "$WORK/run-tensorflow.log"; echo "image-smoke: FAILED: the Keras training run in the tensorflow image"; exit 1; }
grep '^smoke:' "$WORK/run-tensorflow.log"
echo "image-smoke: PASSED: trained with Keras in the tensorflow image in $(( $(date +%s) - t ))s"

# Both images pushed by `make push` to a real registry on 127.0.0.1 (Debian's docker-registry: the Go
# distribution registry), proved by the registry's HTTP API, then pulled into a FRESH Docker daemon
# (its own data root: nothing cached) and run there, with the same image id. Plain HTTP is allowed:
# Docker treats registries on 127.0.0.0/8 as insecure-allowed.
REGISTRY_BIN=$(command -v docker-registry || true)
[ -n "$REGISTRY_BIN" ] || { echo "image-smoke: push NOT CHECKED: no docker-registry (apt-get install docker-registry; .ci/run installs it)"; exit 0; }
t=$(date +%s)
RPORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
rm -rf "$WORK/registry" && mkdir -p "$WORK/registry/data"
printf 'version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: %s\nhttp:\n  addr: 127.0.0.1:%s\n' \
  "$WORK/registry/data" "$RPORT" >"$WORK/registry/config.yml"
"$REGISTRY_BIN" serve "$WORK/registry/config.yml" >"$WORK/registry.log" 2>&1 &
REGISTRY_PID=$!
for _ in $(seq 100); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$RPORT/v2/', timeout=2)" 2>/dev/null && break; sleep 0.2; done
# Both images, under the names `make images` gives them, which `make push` starts from.
declare -A BUILT=([torch]="$IMAGE" [tensorflow]="$IMAGE_TF") DIGESTS=() IDS=()
for v in torch tensorflow; do docker tag "${BUILT[$v]}" "elastic-step-$v:$VERSION"; done
make --no-print-directory push IMAGE_REGISTRY="127.0.0.1:$RPORT/elastic-step" IMAGE_VARIANTS="torch tensorflow" DOCKER="docker -H unix://$SOCK" \
  >"$WORK/push.log" 2>&1 || { tail -20 "$WORK/push.log" "$WORK/registry.log"; echo "image-smoke: FAILED: make push to 127.0.0.1:$RPORT"; exit 1; }
for v in torch tensorflow; do
  REPOSITORY=elastic-step/elastic-step-$v
  proof=$(python3 images/registry_check.py "127.0.0.1:$RPORT" "$REPOSITORY" "$VERSION") \
    || { echo "image-smoke: FAILED: the registry's API does not show the pushed $v image"; exit 1; }
  read -r DIGEST CONFIG <<<"$proof"
  ID=$(docker image inspect -f '{{.Id}}' "${BUILT[$v]}")
  [ "$CONFIG" = "$ID" ] || { echo "image-smoke: FAILED: the registry's manifest of $REPOSITORY names config $CONFIG, the built image is $ID"; exit 1; }
  grep -q "digest: $DIGEST " "$WORK/push.log" || { tail -5 "$WORK/push.log"; echo "image-smoke: FAILED: docker push reported another digest than the registry's $DIGEST for $v"; exit 1; }
  DIGESTS[$v]=$DIGEST IDS[$v]=$ID
  echo "image-smoke: the registry lists $REPOSITORY:$VERSION, manifest $DIGEST, config $CONFIG"
done
# The tensorflow image's push sends only its own layer: the torch image's are already there.
echo "image-smoke: pushed both by make push in $(( $(date +%s) - t ))s ($(grep -c 'Layer already exists\|Mounted from' "$WORK/push.log") layers the registry already held)"

t=$(date +%s)
rm -rf "$FRESH" && mkdir -p "$FRESH"
dockerd --bridge=none --iptables=false --data-root "$FRESH/data" --exec-root "$FRESH/exec" \
  --pidfile "$FRESH/dockerd.pid" -H "unix://$FRESH/docker.sock" >"$WORK/dockerd-fresh.log" 2>&1 &
FRESH_PID=$!
fresh() { docker -H "unix://$FRESH/docker.sock" "$@"; }
for _ in $(seq 150); do fresh version >/dev/null 2>&1 && break; kill -0 "$FRESH_PID" 2>/dev/null || break; sleep 0.2; done
fresh version >/dev/null 2>&1 || { tail -5 "$WORK/dockerd-fresh.log"; echo "image-smoke: FAILED: the fresh Docker daemon did not start"; exit 1; }
[ -z "$(fresh images -q)" ] || { echo "image-smoke: FAILED: the fresh daemon already holds images"; exit 1; }
: >"$WORK/pull.log"
for v in torch tensorflow; do
  REPOSITORY=elastic-step/elastic-step-$v PUSHED=127.0.0.1:$RPORT/elastic-step/elastic-step-$v:$VERSION
  fresh pull "$PUSHED" >>"$WORK/pull.log" 2>&1 \
    || { tail -10 "$WORK/pull.log" "$WORK/dockerd-fresh.log"; echo "image-smoke: FAILED: pull of $PUSHED into a fresh daemon"; exit 1; }
  [ "$(fresh image inspect -f '{{.Id}}' "$PUSHED")" = "${IDS[$v]}" ] || { echo "image-smoke: FAILED: the pulled $v image's id is not the built image's ${IDS[$v]}"; exit 1; }
  fresh image inspect -f '{{join .RepoDigests " "}}' "$PUSHED" | grep -qwF "127.0.0.1:$RPORT/$REPOSITORY@${DIGESTS[$v]}" \
    || { echo "image-smoke: FAILED: the pulled $v image is not the registry's ${DIGESTS[$v]}"; exit 1; }
  said=$(fresh run --rm --network host "$PUSHED" --version 2>&1) || { echo "$said"; echo "image-smoke: FAILED: elastic-step --version in the pulled $v image"; exit 1; }
  [ "$said" = "elastic-step $VERSION" ] || { echo "image-smoke: FAILED: the pulled $v image says $said"; exit 1; }
  echo "image-smoke: PASSED: $v pulled into a fresh daemon, same id ${IDS[$v]} and digest ${DIGESTS[$v]}; it says '$said'"
done
echo "image-smoke: both images pulled and run in the fresh daemon in $(( $(date +%s) - t ))s"
