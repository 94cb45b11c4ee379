# Every target that runs code first makes sure .venv exists and matches pyproject.toml and
# constraints.txt (a no-op when it does), so `make test` works from a clean clone.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stamp-install
EXTRAS ?= torch,tensorflow,dev

.PHONY: install test demo bench compile clean

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

# Generated files are committed; a test fails when one is stale.
compile: $(STAMP)
	$(PY) -m elastic_step.pipelines.compile
	$(PY) -m elastic_step.cli argo render --pipeline all --out pipelines/argo

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache demo-output

# Container images, tagged with the package version (elastic_step.images.default_image()).
.PHONY: images image-smoke
IMAGE_REGISTRY ?= ghcr.io/elastic-step
VERSION = $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' elastic_step/__init__.py)

images:
	docker build -f images/Dockerfile -t $(IMAGE_REGISTRY)/elastic-step-torch:$(VERSION) .
	docker build -f images/Dockerfile --build-arg EXTRAS=torch,tensorflow -t $(IMAGE_REGISTRY)/elastic-step-tensorflow:$(VERSION) .

# Builds the torch image with its own Docker daemon and trains in it; says SKIPPED where it cannot.
image-smoke: $(STAMP)
	images/smoke.sh
