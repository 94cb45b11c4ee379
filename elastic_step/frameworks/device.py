"""Where a worker computes, decided in one place: which device (`--device cpu|cuda|auto`) and
which precision (`--precision fp32|bf16|fp16`), from what the process can see.

The rule, the same for every worker and every backend:
- a worker computes on `cuda:<local index>` when it sees GPUs and may use them: a pod sees the
  GPUs its `nvidia.com/gpu` request gave it (`CUDA_VISIBLE_DEVICES`, set by the device plugin),
  so its local index is 0; local worker processes on one machine share its GPUs, one each by
  the worker's slot (slot mod the number of GPUs);
- `auto` (the default) takes the GPU when there is one and the CPU otherwise; `cuda` insists and
  is refused in one line where no GPU is visible, before the job starts rather than at a step:
  at the master's pre-flight on the local backend (its workers see this machine's GPUs), and on
  Kubernetes when the worker pods request no GPU (`check_gpu_request`, which also refuses GPUs
  asked of an image known to be a CPU-only build); else at each worker's pre-flight.

Precision: `bf16` runs the forward pass under autocast to bfloat16 (CPUs, and GPUs from Ampere
on); `fp16` under autocast to float16 (every GPU, and CPUs whose torch has float16 autocast),
with a loss scale that never skips a step (loss_scale.py: torch's GradScaler skips a step whose
gradients overflow, which would drop rows the ledger counted applied). Parameters, optimizer
state and the summed gradients stay float32. Keras models compute in float32 only.

Nothing here imports CUDA code paths unless asked: `visible_gpus()` asks torch only."""

from __future__ import annotations

import os
from dataclasses import dataclass

from elastic_step.errors import ConfigError
from elastic_step.protocol import DeviceChoice, Precision

__all__ = ["DeviceChoice", "Placement", "Precision", "check_gpu_request", "image_has_cuda", "parse_choice", "parse_precision",
           "place", "placement_here", "worker_slot"]


@dataclass(frozen=True)
class Placement:
    """Where one worker computes, and why (the reason goes to the worker's log)."""

    device: str  # "cpu" or "cuda:N", as torch.device takes it
    precision: Precision
    reason: str
    choice: DeviceChoice = DeviceChoice.AUTO  # what was asked: CUDA insists where AUTO settles

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")


def parse_choice(value: str, flag: str = "--device") -> DeviceChoice:
    try:
        return DeviceChoice(value.strip().lower())
    except ValueError:
        raise ConfigError(f"{flag} {value!r} is not a device: use auto, cpu or cuda") from None


def parse_precision(value: str, flag: str = "--precision") -> Precision:
    try:
        return Precision(value.strip().lower())
    except ValueError:
        raise ConfigError(f"{flag} {value!r} is not a precision: use fp32, bf16 or fp16") from None


def visible_gpus() -> int:
    """How many GPUs this process can use: torch's count, which honours CUDA_VISIBLE_DEVICES;
    0 for a torch built without CUDA (the CPU image)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def place(choice: DeviceChoice, precision: Precision, gpus: int, slot: int = 0,
          bf16_on_gpu: bool = True, fp16_on_cpu: bool = True) -> Placement:
    """The placement rule (module docstring). `gpus`: what visible_gpus() says; `slot`: the
    worker's slot number (its local index among the machine's workers)."""
    if choice == DeviceChoice.CUDA and gpus == 0:
        seen = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = f"CUDA_VISIBLE_DEVICES={seen!r}" if seen is not None else "torch sees no CUDA device (a CPU build, or no GPU in the pod)"
        raise ConfigError(f"--device cuda but this worker sees no GPU ({why}): request nvidia.com/gpu for the "
                          "worker pods with an image built with CUDA, or use --device auto or cpu")
    use_gpu = gpus > 0 and choice != DeviceChoice.CPU
    if precision == Precision.FP16 and not use_gpu and not fp16_on_cpu:
        raise ConfigError("--precision fp16 but this worker computes on the CPU, where this torch has no float16 autocast: "
                          "use bf16 or fp32, or a GPU")
    if precision == Precision.BF16 and use_gpu and not bf16_on_gpu:
        raise ConfigError("--precision bf16 but this GPU has no bfloat16 support (older than Ampere): use fp16 or fp32")
    if not use_gpu:
        why = "asked for the CPU" if choice == DeviceChoice.CPU else "no GPU visible"
        return Placement("cpu", precision, why, choice)
    index = slot % gpus
    return Placement(f"cuda:{index}", precision, f"{gpus} GPU(s) visible; slot {slot} takes cuda:{index}", choice)


def image_has_cuda(image: str, own: bool = False) -> bool | None:
    """Whether the workers' image has a CUDA build of torch. `own`: it is the image this process
    runs in (a master pod whose workers take its image), whose torch says so itself. Otherwise
    only the project's published names are known: `make images` builds them from the CPU wheel
    index (images/Dockerfile's default TORCH_INDEX_URL). None: not known (a user's own image),
    and nothing is refused on a guess."""
    if own:
        import torch

        return torch.version.cuda is not None
    from elastic_step.images import REGISTRY, VARIANTS

    if any(image.startswith(f"{REGISTRY}/elastic-step-{variant}:") for variant in VARIANTS):
        return False
    return None


def check_gpu_request(worker_gpus: int, choice: DeviceChoice, image: str, own: bool = False,
                      flag: str = "--worker-gpus") -> None:
    """Before any pod exists: GPUs asked of an image that cannot use them, or `--device cuda`
    for workers that ask for none (a pod sees only the GPUs it requests)."""
    if worker_gpus < 0:
        raise ConfigError(f"{flag} must be 0 or more (nvidia.com/gpu per worker), got {worker_gpus}")
    if worker_gpus and image_has_cuda(image, own) is False:
        raise ConfigError(f"{flag} {worker_gpus} but the workers' image {image} is a CPU-only build (its torch has no "
                          "CUDA): they could not use a GPU; use an image built with CUDA (images/Dockerfile with a CUDA "
                          f"TORCH_INDEX_URL), or drop {flag}")
    if choice == DeviceChoice.CUDA and not worker_gpus:
        raise ConfigError(f"--device cuda but the worker pods request no GPU, so none will see one: pass {flag} N "
                          "(nvidia.com/gpu per worker), or use --device auto or cpu")


def worker_slot(worker_id: str) -> int:
    """The slot of a worker id `w<slot>.<attempt>` (protocol.WorkerEnv.WORKER_ID); 0 otherwise."""
    head = worker_id.lstrip("w").split(".", 1)[0]
    return int(head) if head.isdigit() else 0


def placement_here(choice: DeviceChoice, precision: Precision, slot: int = 0) -> Placement:
    """place() for this process, asking torch what it sees."""
    gpus = visible_gpus()
    bf16 = True
    if gpus and precision == Precision.BF16:
        import torch

        bf16 = torch.cuda.is_bf16_supported()
    fp16_cpu = precision != Precision.FP16 or cpu_has_fp16_autocast()
    return place(choice, precision, gpus, slot, bf16_on_gpu=bf16, fp16_on_cpu=fp16_cpu)


def cpu_has_fp16_autocast() -> bool:
    """Whether this torch computes a layer under float16 autocast on the CPU (2.4 and later do)."""
    import torch

    try:
        with torch.autocast(device_type="cpu", dtype=torch.float16):
            return torch.nn.functional.linear(torch.ones(1, 2), torch.ones(1, 2)).dtype == torch.float16
    except (RuntimeError, AssertionError):
        return False
