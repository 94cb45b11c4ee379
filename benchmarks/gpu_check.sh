#!/usr/bin/env bash
# The GPU device check: one short script for a machine with a CUDA GPU (see benchmarks/nccl_check.py
# and benchmarks/bench_gpu.py for what they measure and assert). It needs a Python with a CUDA build of torch and the project's
# other requirements; where that Python lacks some and cannot reach an index, carry them as wheels in
# .whl/ (pip download --only-binary=:all: for that Python's version and platform) and they are
# installed beside it first. Exit 0 only when every NCCL check passes and the disturbed run's audit is exact.
#   benchmarks/gpu_check.sh [--copies N] [--epochs N]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu-check-site .whl/*.whl
  export PYTHONPATH=/tmp/gpu-check-site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! "$PY" -c "import elastic_step" 2>/dev/null; then
  # The project itself, without resolving dependencies (the GPU's torch stays the one installed).
  "$PY" -m pip install -q --no-deps --no-build-isolation --target /tmp/gpu-check-site .
  export PYTHONPATH=/tmp/gpu-check-site${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" - <<'PY'
import torch
assert torch.cuda.is_available(), "gpu check: torch sees no GPU (a CPU build of torch, or no GPU on this machine)"
print(f"gpu check: torch {torch.__version__}, {torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}")
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
date -u +"gpu check: %Y-%m-%d %H:%M UTC"
"$PY" benchmarks/nccl_check.py
"$PY" benchmarks/bench_gpu.py --device cuda "$@"
