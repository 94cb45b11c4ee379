"""Loading a user's model definition: a Python module named by import path or by file path.

A model definition provides `model()`, `loss(outputs, labels)` (the batch mean, as plain code
writes it), `optimizer(model)`, and optionally `feed(batch)` and `metrics()`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable

from elastic_step.errors import ModelDefinitionError

REQUIRED = ("model", "loss", "optimizer")


@dataclass
class ModelDefinition:
    source: str
    module: types.ModuleType

    @property
    def model(self) -> Callable[[], Any]:
        return self.module.model

    @property
    def loss(self) -> Callable[[Any, Any], Any]:
        return self.module.loss

    @property
    def optimizer(self) -> Callable[[Any], Any]:
        return self.module.optimizer

    @property
    def feed(self) -> Callable[[dict], tuple] | None:
        return getattr(self.module, "feed", None)

    @property
    def metrics(self) -> Callable[[], dict] | None:
        return getattr(self.module, "metrics", None)


def _import_file(path: str) -> types.ModuleType:
    name = "elastic_step_user_model_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelDefinitionError(f"model definition {path!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_model_definition(source: str) -> ModelDefinition:
    """Import `source` (a module name such as `elastic_step.model_zoo.digits_torch`, or a .py path)."""
    path = source[len("file://"):] if source.startswith("file://") else source
    try:
        if path.endswith(".py") or os.sep in path:
            if not os.path.exists(path):
                raise ModelDefinitionError(
                    f"model definition file {source!r} does not exist; pass a .py file or a module name"
                )
            module = _import_file(os.path.abspath(path))
        else:
            module = importlib.import_module(path)
    except ModelDefinitionError:
        raise
    except ModuleNotFoundError as exc:
        raise ModelDefinitionError(
            f"cannot import model definition {source!r}: {exc}; pass a module name on PYTHONPATH or a .py file"
        ) from exc
    except Exception as exc:  # a user's module may raise anything on import
        raise ModelDefinitionError(
            f"model definition {source!r} raised on import: {type(exc).__name__}: {exc}"
        ) from exc
    missing = [name for name in REQUIRED if not callable(getattr(module, name, None))]
    if missing:
        raise ModelDefinitionError(
            f"model definition {source!r} lacks {', '.join(f'{m}()' for m in missing)}; "
            f"it must define {', '.join(f'{m}()' for m in REQUIRED)}"
        )
    return ModelDefinition(source=source, module=module)


def batch_arrays(model_def: ModelDefinition, batch: dict, features: list[str], label: str):
    """(features, labels) numpy arrays for one minibatch: the model definition's feed() when it
    has one, else the feature columns stacked as float32 and the label column."""
    if model_def.feed is not None:
        x, y = model_def.feed(batch)
    else:
        from elastic_step.data.reader import default_feed

        x, y = default_feed(batch, features, label)
    import numpy as np

    return np.ascontiguousarray(x), np.ascontiguousarray(y)
