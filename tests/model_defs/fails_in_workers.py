"""A model definition that imports in the master but not in a worker (as when a worker image
lacks a package the master's has)."""

import os

from elastic_step.model_zoo.digits_torch import feed, loss, model, optimizer  # noqa: F401

if os.environ.get("ELASTIC_STEP_WORKER_ID"):
    raise ImportError("No module named 'a_package_only_the_master_has'")
