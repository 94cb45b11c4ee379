"""PyTorch adapter: the reference framework.

The model, its optimizer state and each batch live on the placement's device (frameworks/device.py
decides it). Where the worker's flat step buffer lives on that same device (host memory for a
CPU trainer; GPU memory when NCCL sums the step on the trainer's GPU), the parameters' `.grad`
are views of it, so a step copies nothing: autograd accumulates into the buffer, the collective
sums it in place, and the optimizer reads the sum there. Where the buffer lives elsewhere (a GPU
trainer whose step gloo sums in host memory), the step's gradients reach it in one copy of their
concatenation, and the sum returns in one copy."""

from __future__ import annotations

import contextlib
import io
import logging
import math
from dataclasses import dataclass

import numpy as np
import torch

from elastic_step.errors import ModelDefinitionError
from elastic_step.frameworks.api import StateSnapshot, Trainer
from elastic_step.frameworks.device import Placement, Precision
from elastic_step.frameworks.loss_scale import LossScale
from elastic_step.frameworks.model_def import ModelDefinition


log = logging.getLogger("elastic_step.frameworks")


class TorchTrainer(Trainer):
    framework = "pytorch"

    def __init__(self, model_def: ModelDefinition, net: torch.nn.Module, placement: Placement | None = None):
        self.model_def = model_def
        self.placement = placement or Placement("cpu", Precision.FP32, "the default")
        self.device = torch.device(self.placement.device)
        self.net = net.to(self.device)  # before optimizer(): its state is made beside the parameters
        self.optimizer = model_def.optimizer(net)
        self._base_lrs = [group.get("lr") for group in self.optimizer.param_groups]  # the model definition's
        self.params = [p for p in net.parameters() if p.requires_grad]
        self._sizes = [p.numel() for p in self.params]
        self._all_float32 = all(p.dtype == torch.float32 for p in self.params)
        self._views: list[torch.Tensor] = []
        self._views_key: tuple | None = None
        # float16's loss scale, this rank's own (frameworks/loss_scale.py); None in fp32 and bf16.
        self.loss_scale = LossScale() if self.placement.precision == Precision.FP16 else None

    @property
    def num_gradient_values(self) -> int:
        return sum(self._sizes)

    @property
    def passes_computed_again(self) -> int:
        return self.loss_scale.overflows if self.loss_scale is not None else 0

    @property
    def gradient_device(self) -> torch.device:
        """This trainer's own device, CPU or GPU: a step buffer there is used in place."""
        return self.device

    def compute_gradients(self, features, labels, out) -> float:
        if not self.net.training:  # train() walks every module: once, not every step
            self.net.train()
        flat = _flat(out)
        if self.loss_scale is None:
            return self._compute(features, labels, flat, 1.0)
        return self._compute_scaled(features, labels, flat)

    def _compute_scaled(self, features, labels, flat: torch.Tensor) -> float:
        """float16: the rows' gradients at this rank's loss scale, computed again at half of it
        while they overflow (never skipped: loss_scale.py), then divided by it in place."""
        scale = self.loss_scale
        before = _PassStart.of(self.net, self.device)
        while True:
            loss = self._compute(features, labels, flat, scale.value)
            if not math.isfinite(loss):
                return loss  # the forward pass itself overflowed: no factor helps; the step's check fails the job
            if bool(torch.isfinite(flat).all()):
                flat.div_(scale.value)  # a power of two: exact
                scale.passed()
                return loss
            if not scale.overflowed():
                log.error("float16 gradients overflow even at loss scale %g: the model diverges (or its activations "
                          "exceed float16's range); the job fails as on an infinite loss: try bf16 or fp32", scale.value)
                return math.inf
            before.restore()  # the same pass at another scale: BatchNorm sees the batch once, dropout draws alike
            log.info("float16 gradients overflowed at loss scale %g: the same rows again at %g", 2 * scale.value, scale.value)

    def _compute(self, features, labels, flat: torch.Tensor, scale: float) -> float:
        """The rows' summed gradients times `scale` into `flat`; returns their summed loss."""
        if flat.device != self.device:
            return self._compute_staged(features, labels, flat, scale)
        views = self._gradient_views(flat)
        if views is not None:
            # Autograd accumulates into a defined .grad in place: the step buffer itself.
            flat.zero_()
            for p, view in zip(self.params, views):
                p.grad = view
        else:
            for p in self.params:
                p.grad = None
        summed = self._summed_loss(self._to_device(features), self._to_device(labels))
        (summed * scale if scale != 1.0 else summed).backward()
        offset = 0
        for p, size in zip(self.params, self._sizes):
            target = flat[offset:offset + size]
            if p.grad is not None and p.grad.data_ptr() == target.data_ptr():
                pass  # accumulated in the buffer itself
            elif p.grad is None:
                target.zero_()
            else:
                target.copy_(p.grad.reshape(-1))
            offset += size
        return float(summed.detach())

    def _summed_loss(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The sum of per-sample losses: the model definition returns the batch mean, times n is
        the sum, whose gradient is the sum of per-sample gradients. The forward pass runs under
        the placement's autocast; the loss itself in float32."""
        with self._autocast():
            outputs = self.net(features)
        if outputs.dtype != torch.float32 and outputs.is_floating_point() and self.placement.precision != Precision.FP32:
            outputs = outputs.float()
        return self.model_def.loss(outputs, labels) * len(labels)

    def _autocast(self):
        if self.placement.precision == Precision.BF16:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        if self.placement.precision == Precision.FP16:
            return torch.autocast(device_type=self.device.type, dtype=torch.float16)
        return contextlib.nullcontext()

    def _to_device(self, array) -> torch.Tensor:
        tensor = _flat(array)
        if tensor.device == self.device:
            return tensor
        if self.device.type == "cuda":  # pinned memory lets the copy overlap the host's work
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device)

    def _compute_staged(self, features, labels, flat: torch.Tensor, scale: float = 1.0) -> float:
        """The step's gradients (times `scale`) gathered on this trainer's device, then copied
        into `flat`, a buffer on another device, at once."""
        for p in self.params:
            p.grad = None
        summed = self._summed_loss(self._to_device(features), self._to_device(labels))
        (summed * scale if scale != 1.0 else summed).backward()
        parts = [p.grad.reshape(-1).float() if p.grad is not None else torch.zeros(size, device=self.device)
                 for p, size in zip(self.params, self._sizes)]
        flat.copy_(torch.cat(parts))  # the one copy of the step's gradients
        return float(summed.detach())

    def apply_gradients(self, summed, total_samples) -> None:
        flat = _flat(summed)
        if flat.device != self.device:
            self._apply_staged(flat, total_samples)
            return
        views = self._gradient_views(flat)
        if views is not None:
            # Divide in place and let the optimizer read the buffer's views: no copies per step.
            flat.div_(total_samples)
            for p, view in zip(self.params, views):
                p.grad = view
        else:
            offset = 0
            for p, size in zip(self.params, self._sizes):
                p.grad = (flat[offset:offset + size] / total_samples).reshape(p.shape).to(p.dtype)
                offset += size
        self.optimizer.step()

    def _apply_staged(self, flat: torch.Tensor, total_samples: int) -> None:
        """The summed gradients of a buffer on another device, copied here at once and applied."""
        flat = self._to_device(flat).div_(total_samples)  # the one copy back
        offset = 0
        for p, size in zip(self.params, self._sizes):
            p.grad = flat[offset:offset + size].view(p.shape).to(p.dtype)
            offset += size
        self.optimizer.step()

    def scale_learning_rate(self, factor) -> None:
        if any(not isinstance(lr, (int, float)) for lr in self._base_lrs):
            raise ModelDefinitionError(f"--lr-scaling needs a number as each parameter group's lr; optimizer() of "
                                       f"{self.model_def.source!r} gives {self._base_lrs}")
        for group, base in zip(self.optimizer.param_groups, self._base_lrs):
            group["lr"] = base * factor

    def _gradient_views(self, flat: torch.Tensor) -> list[torch.Tensor] | None:
        """Views of the flat step buffer shaped like each parameter (built once per buffer),
        or None when a parameter is not float32 (its gradient is then copied and cast)."""
        if not self._all_float32:
            return None
        key = (flat.data_ptr(), flat.numel(), flat.device)
        if key != self._views_key:
            views, offset = [], 0
            for p, size in zip(self.params, self._sizes):
                views.append(flat[offset:offset + size].view(p.shape))
                offset += size
            self._views, self._views_key = views, key
        return self._views

    def state_bytes(self) -> bytes:
        buffer = io.BytesIO()
        torch.save(_on_cpu(self._live_state()), buffer)
        return buffer.getvalue()

    def _live_state(self) -> dict:
        """What state_bytes() saves, as live tensors (the model's, the optimizer's, the generators')."""
        return {"model": self.net.state_dict(), "optimizer": self.optimizer.state_dict(), **self._rng_states()}

    def _rng_states(self) -> dict:
        """The random generators a step draws from: the CPU's, and this trainer's GPU's (dropout
        on a GPU draws there), each a CPU tensor."""
        states = {"rng": torch.get_rng_state()}
        if self.device.type == "cuda":
            states["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        return states

    def state_snapshot(self) -> StateSnapshot:
        """The state as state_bytes() would save it, copied at this step into host memory: the
        tensors of each device and dtype into one flat host buffer (from a GPU, asynchronous
        copies into pinned memory, waited for once), serialised later by to_bytes()."""
        return _HostCopy(self._live_state())

    def load_state_bytes(self, data: bytes) -> None:
        # Saved from CPU copies: loadable by the CPU-only master and by any device's worker. Read
        # onto the CPU, as torch advises: the model copies its tensors to its own device, the
        # optimizer moves its state beside each parameter but keeps Adam's step counters on the
        # CPU (a counter moved to a GPU fails Adam's first step), and the generators' states
        # must be CPU tensors.
        state = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        self.net.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if "rng" in state:
            torch.set_rng_state(state["rng"])
        if "cuda_rng" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)

    def model_bytes(self) -> bytes:
        buffer = io.BytesIO()
        torch.save(_on_cpu(self.net.state_dict()), buffer)
        return buffer.getvalue()

    def load_model_bytes(self, data: bytes) -> None:
        self.net.load_state_dict(torch.load(io.BytesIO(data), weights_only=True, map_location=self.device))

    def model_bytes_of_state(self, data: bytes) -> bytes:
        """The parameters part of a state_bytes() blob (warm start from a checkpoint)."""
        buffer = io.BytesIO()
        torch.save(torch.load(io.BytesIO(data), weights_only=True)["model"], buffer)
        return buffer.getvalue()

    def model_bytes_of_logged_model(self, model_uri: str) -> bytes:
        """The weights of the run a logged or registered model comes from (its own weights file,
        checked to be a state dict of this network with `weights_only=True`), as model_bytes().
        Nothing is unpickled: MLflow's pytorch flavour is never loaded."""
        from elastic_step.frameworks.weights import WeightsError, final_model_bytes

        data = final_model_bytes(model_uri)
        try:
            state = torch.load(io.BytesIO(data), weights_only=True)
            self.net.load_state_dict(state)
        except Exception as exc:
            raise WeightsError(f"the weights of {model_uri!r} do not fit this model definition's network "
                               f"({type(exc).__name__}: {str(exc)[:200]})") from None
        return data

    def predict(self, features):
        self.net.eval()
        with torch.no_grad(), self._autocast():
            outputs = self.net(self._to_device(features))
        return (outputs.float() if outputs.dtype in (torch.bfloat16, torch.float16) else outputs).cpu().numpy()

    def loss_value(self, outputs, labels) -> float:
        with torch.no_grad():
            return float(self.model_def.loss(torch.from_numpy(outputs), torch.from_numpy(labels)))

    def log_mlflow_model(self, input_example, signature):
        """The final model as an MLflow pytorch model. Explicit pip requirements keep logging
        well under a second (inferring them imports and scans the environment)."""
        import mlflow.pytorch

        return mlflow.pytorch.log_model(
            self.net,
            name="model",
            signature=signature,
            input_example=input_example,
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", f"numpy=={np.__version__}"],
        )

    def log_serving_model(self, input_example, signature):
        """The model as TorchScript (loadable without this model definition's Python code, and
        from C++), logged as an MLflow pytorch model named "serving-model"."""
        import warnings

        import mlflow.pytorch

        self.net.eval()
        with warnings.catch_warnings():
            # torch 2.13 marks TorchScript deprecated in favour of torch.export; it is still the
            # format serving stacks (TorchServe, Triton's libtorch backend) load.
            warnings.simplefilter("ignore", category=DeprecationWarning)
            warnings.simplefilter("ignore", category=FutureWarning)
            scripted = torch.jit.trace(self.net, torch.from_numpy(input_example))
        return mlflow.pytorch.log_model(
            scripted,
            name="serving-model",
            signature=signature,
            input_example=input_example,
            serialization_format="pickle",  # MLflow saves a ScriptModule with torch.jit.save
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", f"numpy=={np.__version__}"],
        )


class _HostCopy(StateSnapshot):
    """A state dict's tensors copied to host memory at once, apart from the live ones: grouped by
    device and dtype, each group into one flat host buffer (pinned for a GPU's tensors, which are
    copied asynchronously and waited for once; no second copy is made in the GPU's memory).
    to_bytes() rebuilds the state dict from those copies and saves it as state_bytes() does."""

    def __init__(self, state):
        tensors: list[torch.Tensor] = []
        self._skeleton = _hollowed(state, tensors)
        self._shapes = [t.shape for t in tensors]
        groups: dict[tuple, list[int]] = {}
        for i, t in enumerate(tensors):
            groups.setdefault((t.device, t.dtype), []).append(i)
        self._groups = [(members, _copied_to_host([tensors[i] for i in members], device, dtype))
                        for (device, dtype), members in groups.items()]
        for device in {device for device, _ in groups if device.type == "cuda"}:
            # Each GPU's own (a local worker's may not be the current one): the asynchronous
            # copies have landed before training changes the tensors.
            torch.cuda.synchronize(device)

    def to_bytes(self) -> bytes:
        copies: list[torch.Tensor | None] = [None] * len(self._shapes)
        for members, flat in self._groups:
            for i, part in zip(members, torch.split(flat, [self._shapes[i].numel() for i in members])):
                copies[i] = part.view(self._shapes[i]).clone()  # each its own storage, as state_bytes() saves
        buffer = io.BytesIO()
        torch.save(_filled(self._skeleton, copies), buffer)
        return buffer.getvalue()


def _copied_to_host(tensors: list[torch.Tensor], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """One flat host buffer holding `tensors` (all of `device` and `dtype`) one after another."""
    on_gpu = device.type == "cuda"
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, pin_memory=on_gpu)
    offset = 0
    for t in tensors:
        flat[offset:offset + t.numel()].copy_(t.detach().reshape(-1), non_blocking=on_gpu)
        offset += t.numel()
    return flat


class _Slot(int):
    """Where the i-th tensor of a hollowed state dict goes back."""


def _hollowed(tree, tensors: list):
    """`tree` with fresh containers and each tensor replaced by its _Slot (appended to `tensors`)."""
    if isinstance(tree, torch.Tensor):
        tensors.append(tree)
        return _Slot(len(tensors) - 1)
    if isinstance(tree, dict):
        return {key: _hollowed(value, tensors) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_hollowed(value, tensors) for value in tree)
    return tree


def _filled(tree, tensors: list):
    if isinstance(tree, _Slot):
        return tensors[tree]
    if isinstance(tree, dict):
        return {key: _filled(value, tensors) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_filled(value, tensors) for value in tree)
    return tree


@dataclass
class _PassStart:
    """What a forward pass changes besides the gradients, as it was before the pass: the model's
    buffers (BatchNorm's running statistics and batch count) and the random generators' states
    (dropout's draws). Put back before an overflowed float16 pass is computed again, so that the
    pass computed again is the same pass at a smaller scale and the model is as if it ran once.

    A buffer is kept by its module and name: a module may update one in place (BatchNorm) or
    assign a new tensor to it (`self.seen = self.seen + 1`), and either is undone. The buffers are
    copied before every float16 pass: little for BatchNorm's, a copy per pass of a model whose
    buffers are large."""

    buffers: list[tuple[torch.nn.Module, str, torch.Tensor, torch.Tensor]]  # (module, name, the tensor then, a copy)
    cpu_rng: torch.Tensor
    device_rng: torch.Tensor | None  # the GPU's generator, when the trainer computes on one
    device: torch.device

    @classmethod
    def of(cls, net: torch.nn.Module, device: torch.device) -> "_PassStart":
        on_gpu = device.type == "cuda"
        buffers = [(module, name, buffer, buffer.detach().clone())
                   for module in net.modules() for name, buffer in module.named_buffers(recurse=False)]
        return cls(buffers, torch.get_rng_state(), torch.cuda.get_rng_state(device) if on_gpu else None, device)

    def restore(self) -> None:
        with torch.no_grad():
            for module, name, then, copy in self.buffers:
                if getattr(module, name) is then:
                    then.copy_(copy)  # updated in place: the same tensor, its old values
                else:  # replaced by the pass: the old value back, as a copy (the pass again may change it)
                    setattr(module, name, copy.clone())
        torch.set_rng_state(self.cpu_rng)
        if self.device_rng is not None:
            torch.cuda.set_rng_state(self.device_rng, self.device)


def _flat(buffer) -> torch.Tensor:
    """A step buffer as a tensor: a numpy buffer's memory seen by torch, a tensor as it is."""
    return buffer if isinstance(buffer, torch.Tensor) else torch.from_numpy(buffer)


def _on_cpu(state):
    """A state dict (nested dicts and lists of tensors) with every tensor on the CPU: what a
    checkpoint, the master and a worker of any device can load. A no-op for CPU tensors."""
    if isinstance(state, torch.Tensor):
        return state.detach().cpu()
    if isinstance(state, dict):
        return {key: _on_cpu(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_on_cpu(value) for value in state)
    return state
