# Every target that runs code first makes sure .venv exists and matches pyproject.toml and
# constraints.txt (a no-op when it does), so `make test` works from a clean clone.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stamp-install
EXTRAS ?= torch,tensorflow,dev

.PHONY: install test demo bench compile clean cluster cluster-stop

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q 'pip>=24'
	$(PY) -m pip install -q -c constraints.txt -e '.[$(EXTRAS)]'
	$(PY) -m pip check
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -ra

demo: $(STAMP)
	$(PY) -m elastic_step.pipelines.demo

# The tests' cluster stand-in, for trying by hand (tests/cluster/local.py): API server, scheduler,
# kubelet, S3 and MLflow on 127.0.0.1; it prints how to use it. `make cluster CLUSTER_DOCKER=1`: the Docker
# runtime on the image `make image-smoke` builds; CLUSTER_POD_NETWORK=1: each pod on an address of its own,
# NetworkPolicies enforced (both: Docker pods, each on its own address). Ctrl-C or `make cluster-stop` stops it.
cluster: $(STAMP)
	PYTHONPATH=tests $(PY) -m cluster.local $(if $(CLUSTER_DOCKER),--docker) $(if $(CLUSTER_POD_NETWORK),--pod-network)

cluster-stop:
	@if [ -f build/cluster/cluster.pid ]; then kill -TERM $$(cat build/cluster/cluster.pid); else echo "no local cluster runs (build/cluster/cluster.pid)"; fi

# Generated files are committed; a test fails when one is stale.
# The committed files name the images in the project's registry; for a cluster's own registry, compile
# or render into a folder of your own (README: "Images for a cluster"). The Argo templates take MLflow's
# URI and user from the Secret mlflow-credentials (elastic_step.defaults.MLFLOW_CREDENTIALS_SECRET).
compile: $(STAMP)
	$(PY) -m elastic_step.pipelines.compile $(IMAGE_ARGS)
	$(PY) -m elastic_step.cli argo render --pipeline all --out pipelines/argo --mlflow-secret mlflow-credentials $(IMAGE_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache demo-output

# Container images: IMAGE_REGISTRY/elastic-step-VARIANT:IMAGE_VERSION, the names elastic_step/images.py
# gives (a test keeps the two in step). `make images` builds each variant under its local name
# elastic-step-VARIANT:VERSION and tags it into IMAGE_REGISTRY; `make push IMAGE_REGISTRY=...` tags
# the local builds into that registry and pushes them (log in first: docker login REGISTRY).
# IMAGE_VARIANTS=torch: build or push only the torch image. The tensorflow image is the torch image's
# layers plus one (TensorFlow, Keras): built after it, it reuses them, and a push sends only that one.
# `make image-smoke` builds both, trains in each, pushes both this way to a registry it serves on
# 127.0.0.1 and pulls them back into a fresh Docker daemon.
# Each variant installs exactly images/lock/ (hashes checked; regenerate with images/lock.sh after
# changing constraints.txt). CPU torch; a CUDA build needs its own locks (see images/lock.sh) and
# IMAGE_BUILD_ARGS='--build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 --build-arg LOCK=...
# --build-arg EXTRAS_LOCK=...' (EXTRAS_LOCK: the tensorflow image's).
.PHONY: images push image-smoke
IMAGE_REGISTRY ?= ghcr.io/elastic-step
VERSION = $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' elastic_step/__init__.py)
IMAGE_VERSION ?= $(VERSION)
IMAGE_VARIANTS ?= torch tensorflow
IMAGE_BUILD_ARGS ?=
DOCKER ?= docker
IMAGE_ARGS = --image-registry $(IMAGE_REGISTRY) --image-version $(IMAGE_VERSION)
extras_torch = torch
extras_tensorflow = torch,tensorflow
local_image = elastic-step-$(1):$(VERSION)
registry_image = $(IMAGE_REGISTRY)/elastic-step-$(1):$(IMAGE_VERSION)

define build_image
	$(DOCKER) build -f images/Dockerfile --build-arg EXTRAS=$(extras_$(1)) $(IMAGE_BUILD_ARGS) -t $(call local_image,$(1)) .
	$(DOCKER) tag $(call local_image,$(1)) $(call registry_image,$(1))

endef
define push_image
	$(DOCKER) tag $(call local_image,$(1)) $(call registry_image,$(1))
	$(DOCKER) push $(call registry_image,$(1))

endef

images:
	$(foreach v,$(IMAGE_VARIANTS),$(call build_image,$(v)))

push:
	$(foreach v,$(IMAGE_VARIANTS),$(call push_image,$(v)))

# Builds both images with its own Docker daemon, trains in each and pushes them to a registry on
# 127.0.0.1; says SKIPPED where it cannot.
image-smoke: $(STAMP)
	images/smoke.sh
