"""Chooses the framework adapter from what the model definition's `model()` returns, so that
a user never names the framework. Frameworks are imported only when their model is seen
(importing TensorFlow costs seconds)."""

from __future__ import annotations

import sys

from elastic_step.errors import ModelDefinitionError
from elastic_step.frameworks.api import Trainer
from elastic_step.frameworks.model_def import ModelDefinition, load_model_definition


def _is_torch_module(obj) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def _is_keras_model(obj) -> bool:
    # tf.keras.Model is keras.Model under TensorFlow >= 2.16, and using either imports `keras`.
    keras = sys.modules.get("keras")
    return keras is not None and isinstance(obj, keras.Model)


def build_trainer(model_def: ModelDefinition, seed: int = 0) -> Trainer:
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

        return TorchTrainer(model_def, net)
    if _is_keras_model(net):
        from elastic_step.frameworks.keras_trainer import KerasTrainer

        return KerasTrainer(model_def, net)
    raise ModelDefinitionError(
        f"model() of {model_def.source!r} returned {type(net).__name__}; "
        "supported: a torch.nn.Module or a keras.Model (TensorFlow backend)"
    )


def trainer_for(source: str, seed: int = 0) -> Trainer:
    return build_trainer(load_model_definition(source), seed=seed)
