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
	$(PY) -m elastic_step.demo

# Generated files are committed; a test fails when one is stale.
compile: $(STAMP)
	$(PY) -m elastic_step.pipelines.compile
	$(PY) -m elastic_step.cli argo render --pipeline all --out pipelines/argo

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache demo-output
