"""Chooses the framework adapter from what the model definition's `model()` returns, so that
a user never names the framework. Frameworks are imported only when their model is seen
(importing TensorFlow costs seconds)."""

from __future__ import annotations

import logging
import sys

from elastic_step.errors import ConfigError, ModelDefinitionError
from elastic_step.frameworks.api import Trainer
from elastic_step.frameworks.device import DeviceChoice, Placement, Precision
from elastic_step.frameworks.model_def import ModelDefinition, load_model_definition


def _is_torch_module(obj) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def _is_keras_model(obj) -> bool:
    # tf.keras.Model is keras.Model under TensorFlow >= 2.16, and using either imports `keras`.
    keras = sys.modules.get("keras")
    return keras is not None and isinstance(obj, keras.Model)


log = logging.getLogger("elastic_step.frameworks")


def build_trainer(model_def: ModelDefinition, seed: int = 0, placement: Placement | None = None) -> Trainer:
    """The model definition's trainer, on `placement` (frameworks/device.py; None: the CPU)."""
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(seed)
    if "keras" in sys.modules:  # only a model definition that imported Keras pays for TensorFlow
        from elastic_step.frameworks.keras_trainer import prepare_runtime

        prepare_runtime(seed)
    try:
        net = model_def.model()
    except Exception as exc:
        raise ModelDefinitionError(
            f"model() of {model_def.source!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    if _is_torch_module(net):
        from elastic_step.frameworks.torch_trainer import TorchTrainer

        return TorchTrainer(model_def, net, placement)
    if _is_keras_model(net):
        from elastic_step.frameworks.keras_trainer import KerasTrainer

        _check_keras_placement(placement)
        return KerasTrainer(model_def, net)
    raise ModelDefinitionError(
        f"model() of {model_def.source!r} returned {type(net).__name__}; "
        "supported: a torch.nn.Module or a keras.Model (TensorFlow backend)"
    )


def trainer_for(source: str, seed: int = 0) -> Trainer:
    return build_trainer(load_model_definition(source), seed=seed)


def _check_keras_placement(placement: Placement | None) -> None:
    """TensorFlow places a Keras model's ops itself, on a GPU when its build has CUDA and sees
    one. Where the placement wanted a GPU that this TensorFlow cannot use (the tensorflow-cpu
    image), --device cuda is refused and auto says in one line that it trains on the CPU. A
    Keras model computes in float32: another precision is refused, not ignored."""
    if placement is not None and placement.precision != Precision.FP32:
        raise ConfigError(f"--precision {placement.precision.value}: Keras models train in float32 here (only PyTorch "
                          "models run under autocast); use --precision fp32")
    if placement is None or not placement.on_gpu:
        return
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        return
    message = "this image's TensorFlow has no CUDA build (or sees no GPU), so the Keras model trains on the CPU"
    if placement.choice == DeviceChoice.CUDA:
        raise ConfigError(f"--device cuda: {message}; use an image with TensorFlow built for CUDA, or --device cpu")
    log.warning("%s although %s", message, placement.reason)
