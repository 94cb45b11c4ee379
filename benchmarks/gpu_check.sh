#!/usr/bin/env bash
# The GPU device check: one short script for a machine with a CUDA GPU (see benchmarks/nccl_check.py
# and benchmarks/bench_gpu.py for what they measure and assert). It needs a Python with a CUDA build of
# torch; what else the project needs and that Python lacks (MLflow, FastAPI, pydantic, ...) travels as
# wheels in .whl/, made here by `python benchmarks/gpu_wheels.py PRESENT` from that machine's
# `pip list --format=freeze`, and installed beside it first, with the project itself.
# Exit 0 only when every NCCL check passes and the disturbed run's audit is exact.
#   benchmarks/gpu_check.sh [--copies N] [--epochs N]
# GPU_CHECK_DEVICE=cpu runs the same script on the CPU with gloo (how it is tested without a GPU);
# GPU_CHECK_WHEELS names another folder of wheels than .whl/.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
WHEELS=${GPU_CHECK_WHEELS:-$ROOT/.whl}
export PYTHONUNBUFFERED=1
# Everything runs from a scratch folder: from the checkout, `python -m elastic_step.cli` (the
# benchmarks' jobs) would import the checkout's elastic_step, which lacks the model zoo that only
# an installed project maps into it.
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
cd "$SCRATCH"
if [ -d "$WHEELS" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SCRATCH/site" "$WHEELS"/*.whl
fi
# The checkout itself, always (an elastic_step installed before may be another's), without resolving
# dependencies (the GPU's torch stays the one installed).
"$PY" -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target "$SCRATCH/site" "$ROOT"
export PYTHONPATH=$SCRATCH/site${PYTHONPATH:+:$PYTHONPATH}
if [ "$DEVICE" = cuda ]; then
  "$PY" - <<'PY'
import torch
assert torch.cuda.is_available(), "gpu check: torch sees no GPU (a CPU build of torch, or no GPU on this machine)"
print(f"gpu check: torch {torch.__version__}, {torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}")
PY
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
date -u +"gpu check: %Y-%m-%d %H:%M UTC"
"$PY" "$ROOT/benchmarks/nccl_check.py" --device "$DEVICE"
"$PY" "$ROOT/benchmarks/bench_gpu.py" --device "$DEVICE" "$@"
