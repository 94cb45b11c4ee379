"""Workers and PS shards keep a step's memory between steps (elastic_step/allocator.py): a step
that allocates and frees the same numpy temporaries reuses their pages instead of faulting in
fresh ones every time. Measured from the process's own page-fault counter, in fresh processes."""

import subprocess
import sys

PROGRAM = """
import resource, sys
import numpy as np
from elastic_step.allocator import keep_step_memory
applied = keep_step_memory() if sys.argv[1] == "tuned" else None
from elastic_step.ps.api import TableSpec
from elastic_step.ps.table import initial_weights
spec, ids = TableSpec("t", 9), np.arange(6_000, dtype=np.int64)  # a shard's new rows of one step
for _ in range(5):
    initial_weights(spec, ids)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(200):
    initial_weights(spec, ids)
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str, env: dict | None = None) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, check=True, env=env)
    applied, faults = out.stdout.split()
    return applied, int(faults)


def test_a_steady_step_reuses_its_pages_once_tuned():
    _, default_faults = _faults("default")
    applied, tuned_faults = _faults("tuned")
    assert applied == "True"
    # glibc's defaults give the temporaries' pages back and fault them in again: ~280 per call
    assert default_faults > 200 * 50, default_faults
    assert tuned_faults < default_faults / 20, (tuned_faults, default_faults)


def test_the_users_own_malloc_settings_stand():
    import os

    applied, _ = _faults("tuned", env={**os.environ, "MALLOC_TRIM_THRESHOLD_": "131072"})
    assert applied == "False"
