"""TensorFlow 2 / Keras 3 adapter, at parity with the PyTorch reference.

Gradients come from `tf.GradientTape` and leave as one flat float32 tensor, copied into the
worker's collective buffer; the allreduced sum comes back as a numpy view and is applied with
the model definition's Keras optimizer. The forward/backward pass and the apply are traced
once with `tf.function` (as `model.fit` does); a model compiled with `run_eagerly=True` is run
eagerly instead. This module imports TensorFlow: the registry imports it only for a model
definition that has imported Keras already.
"""

from __future__ import annotations

import io
import logging
import os

import numpy as np
import tensorflow as tf
import keras

from elastic_step.errors import ModelDefinitionError
from elastic_step.frameworks.api import Trainer
from elastic_step.frameworks.model_def import ModelDefinition

log = logging.getLogger("elastic_step.frameworks")

PREDICT_CHUNK = 8192  # rows per forward pass in predict(): bounds memory on large splits


def prepare_runtime(seed: int) -> None:
    """Seed Keras (Python, numpy and TensorFlow generators) and cap TensorFlow's thread pools
    before model() creates the first tensor. The local backend gives each worker
    OMP_NUM_THREADS=1 so that N workers on a few cores do not oversubscribe them; TensorFlow
    does not read that variable, so it is applied here."""
    keras.utils.set_random_seed(seed)
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        try:
            tf.config.threading.set_intra_op_parallelism_threads(int(threads))
            tf.config.threading.set_inter_op_parallelism_threads(int(threads))
        except RuntimeError:  # the model definition ran TensorFlow ops at import time
            log.warning("TensorFlow started before its thread pools could be sized; using its defaults")


def tensorflow_requirements() -> list[str]:
    """Pinned pip requirements of the running TensorFlow stack (tensorflow or tensorflow-cpu)."""
    from importlib import metadata

    requirements = []
    for dist in ("tensorflow", "tensorflow-cpu"):
        try:
            requirements.append(f"{dist}=={metadata.version(dist)}")
            break
        except metadata.PackageNotFoundError:
            continue
    else:
        requirements.append(f"tensorflow=={tf.__version__}")
    return requirements + [f"keras=={keras.__version__}", f"numpy=={np.__version__}"]


class KerasTrainer(Trainer):
    framework = "tensorflow"

    def __init__(self, model_def: ModelDefinition, model: keras.Model):
        if keras.backend.backend() != "tensorflow":
            raise ModelDefinitionError(
                f"model() of {model_def.source!r} is a Keras model on the {keras.backend.backend()!r} backend; "
                "set KERAS_BACKEND=tensorflow (or return a torch.nn.Module for PyTorch)"
            )
        if not model.built:
            raise ModelDefinitionError(
                f"model() of {model_def.source!r} returned a Keras model without weights yet; "
                "give it an input shape (keras.Input(shape=...)) so its weights exist before training"
            )
        self.model_def = model_def
        self.model = model
        try:
            self.optimizer = model_def.optimizer(model)
        except Exception as exc:
            raise ModelDefinitionError(f"optimizer() of {model_def.source!r} raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(self.optimizer, keras.optimizers.Optimizer):
            raise ModelDefinitionError(
                f"optimizer() of {model_def.source!r} returned {type(self.optimizer).__name__}; "
                "it must return a keras.optimizers.Optimizer"
            )
        self.variables = list(model.trainable_variables)
        self._base_lr = getattr(self.optimizer, "_learning_rate", None)
        if isinstance(self._base_lr, keras.Variable):  # a constant rate (not a schedule): the model definition's value
            self._base_lr = float(self._base_lr.numpy())
        # Optimizer slots exist from the start, so a rank that has not stepped yet has the same
        # state layout as the state source and can load its broadcast.
        self.optimizer.build(self.variables)
        self._sizes = [int(np.prod(v.shape)) for v in self.variables]
        self._eager = bool(getattr(model, "run_eagerly", False))
        self._gradient_fns: dict = {}  # (dtype, shape[1:]) of features and labels -> traced function
        self._apply_fn = self._trace(self._apply, [tf.TensorSpec([sum(self._sizes)], tf.float32), tf.TensorSpec([], tf.float32)])
        # Evaluation sees a few batch sizes (a check batch, splits, chunks): one general trace.
        self._forward = self._trace(lambda x: self.model(x, training=False), None)

    def _trace(self, fn, signature):
        if self._eager:
            return fn
        return tf.function(fn, input_signature=signature, reduce_retracing=signature is None)

    # -- gradients --------------------------------------------------------------------------
    @property
    def num_gradient_values(self) -> int:
        return sum(self._sizes)

    def _gradients(self, features, labels):
        with tf.GradientTape() as tape:
            outputs = self.model(features, training=True)
            mean_loss = self.model_def.loss(outputs, labels)
            # The model definition returns the batch mean; times n is the sum of per-sample
            # losses, whose gradient is the sum of per-sample gradients.
            summed = mean_loss * tf.cast(tf.shape(labels)[0], mean_loss.dtype)
        grads = tape.gradient(summed, self.variables)
        flat = [
            tf.zeros([size], tf.float32) if g is None else tf.reshape(tf.cast(tf.convert_to_tensor(g), tf.float32), [-1])
            for g, size in zip(grads, self._sizes)
        ]
        return tf.concat(flat, axis=0), tf.cast(summed, tf.float32)

    def _gradient_fn(self, features: np.ndarray, labels: np.ndarray):
        key = (features.dtype.str, features.shape[1:], labels.dtype.str, labels.shape[1:])
        fn = self._gradient_fns.get(key)
        if fn is None:  # one trace per input layout; the batch dimension stays free (ragged last batches)
            signature = [tf.TensorSpec([None, *a.shape[1:]], tf.as_dtype(a.dtype)) for a in (features, labels)]
            fn = self._gradient_fns[key] = self._trace(self._gradients, signature)
        return fn

    def compute_gradients(self, features, labels, out) -> float:
        flat, summed = self._gradient_fn(features, labels)(features, labels)
        np.copyto(out, flat.numpy())
        return float(summed)

    def _apply(self, summed, total_samples):
        pieces = tf.split(summed / total_samples, self._sizes)
        grads = [tf.cast(tf.reshape(g, v.shape), v.dtype) for g, v in zip(pieces, self.variables)]
        self.optimizer.apply(grads, self.variables)

    def apply_gradients(self, summed, total_samples) -> None:
        self._apply_fn(summed, np.float32(total_samples))

    def scale_learning_rate(self, factor) -> None:
        if not isinstance(self._base_lr, float):
            raise ModelDefinitionError(f"--lr-scaling needs a constant learning rate; optimizer() of {self.model_def.source!r} "
                                       f"gives {type(self._base_lr).__name__} (a schedule sets the rate itself)")
        self.optimizer.learning_rate = self._base_lr * factor  # assigns the optimizer's variable, outside the trace

    def warm_up(self, features, labels) -> None:
        # One real step: a traced function's first call also builds its runtime graph, which
        # costs as much as the trace. Then every variable goes back as it was (weights,
        # optimizer slots and iteration count, RNG seeds): the state is exactly the built one.
        saved = self.state_bytes()
        scratch = np.zeros(self.num_gradient_values, dtype=np.float32)
        self.compute_gradients(features, labels, scratch)
        self.apply_gradients(scratch, len(labels))
        self.load_state_bytes(saved)

    # -- state ------------------------------------------------------------------------------
    def _state_groups(self) -> dict[str, list]:
        """Every variable whose value must travel: the model's weights (trainable and not),
        its other variables (dropout seed generators: the RNG state) and the optimizer's
        (iteration count, slots)."""
        weight_ids = {id(w) for w in self.model.weights}
        return {
            "weight": list(self.model.weights),
            "extra": [v for v in self.model.variables if id(v) not in weight_ids],
            "optimizer": list(self.optimizer.variables),
        }

    @staticmethod
    def _pack(arrays: dict[str, np.ndarray]) -> bytes:
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        return buffer.getvalue()

    @staticmethod
    def _unpack(data: bytes, what: str) -> dict[str, np.ndarray]:
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as archive:
                return {name: archive[name] for name in archive.files}
        except Exception as exc:
            raise ValueError(f"{what} is not a Keras state written by elastic-step: {type(exc).__name__}: {exc}") from None

    def _assign(self, group: str, variables: list, arrays: dict[str, np.ndarray], what: str) -> None:
        values = [arrays.get(f"{group}_{i}") for i in range(len(variables))]
        if f"{group}_{len(variables)}" in arrays or any(
            v is None or tuple(v.shape) != tuple(var.shape) for v, var in zip(values, variables)
        ):
            raise ValueError(
                f"{what} does not match this model's {group} variables ({len(variables)}); "
                "was it saved from a different model definition?"
            )
        for var, value in zip(variables, values):
            var.assign(value)

    def state_bytes(self) -> bytes:
        return self._pack({
            f"{group}_{i}": np.asarray(v.numpy()) for group, variables in self._state_groups().items() for i, v in enumerate(variables)
        })

    def load_state_bytes(self, data: bytes) -> None:
        arrays = self._unpack(data, "state")
        for group, variables in self._state_groups().items():
            self._assign(group, variables, arrays, "state")

    def model_bytes(self) -> bytes:
        return self._pack({f"weight_{i}": np.asarray(w.numpy()) for i, w in enumerate(self.model.weights)})

    def load_model_bytes(self, data: bytes) -> None:
        self._assign("weight", list(self.model.weights), self._unpack(data, "model"), "model")

    def model_bytes_of_state(self, data: bytes) -> bytes:
        arrays = self._unpack(data, "state")
        return self._pack({name: value for name, value in arrays.items() if name.startswith("weight_")})

    def model_bytes_of_logged_model(self, model_uri: str) -> bytes:
        """The weights of the run a logged or registered model comes from (its own `.npz`
        weights file, read with `allow_pickle=False`), as model_bytes(). MLflow's Keras model
        file (which may carry code) is never loaded."""
        from elastic_step.frameworks.weights import WeightsError, final_model_bytes

        data = final_model_bytes(model_uri)
        try:
            self.load_model_bytes(data)
        except Exception as exc:
            raise WeightsError(f"the weights of {model_uri!r} do not fit this model definition's network "
                               f"({type(exc).__name__}: {str(exc)[:200]})") from None
        return data

    # -- inference --------------------------------------------------------------------------
    def predict(self, features):
        chunks = [self._forward(features[i:i + PREDICT_CHUNK]) for i in range(0, len(features), PREDICT_CHUNK)]
        return np.concatenate([np.asarray(c) for c in chunks]) if chunks else np.asarray(self._forward(features))

    def loss_value(self, outputs, labels) -> float:
        return float(self.model_def.loss(tf.constant(outputs), tf.constant(labels)))

    # -- MLflow -----------------------------------------------------------------------------
    def log_mlflow_model(self, input_example, signature):
        """The final model as an MLflow tensorflow model (a .keras file). Explicit pip
        requirements keep logging well under a second (inferring them imports and scans the
        environment)."""
        import mlflow.tensorflow

        return mlflow.tensorflow.log_model(
            self.model, name="model", signature=signature, input_example=input_example,
            pip_requirements=tensorflow_requirements(),
        )

    def log_serving_model(self, input_example, signature):
        """The final model as a TensorFlow SavedModel (tensorflow flavour): its `serving_default`
        signature serves the forward pass for TensorFlow Serving, and
        `mlflow.pyfunc.load_model(uri).predict(numpy)` returns the outputs."""
        import mlflow.tensorflow

        from elastic_step.frameworks.keras_serving import serving_module

        module = serving_module(self.model, np.asarray(input_example))
        return mlflow.tensorflow.log_model(
            module, name="serving-model", signature=signature, input_example=input_example,
            pip_requirements=tensorflow_requirements(),
            saved_model_kwargs={"signatures": {"serving_default": module.__call__}},
        )
