"""A Keras model as a plain `tf.Module` for a SavedModel: one traced forward pass with a free
batch dimension, so TensorFlow Serving (its `serving_default` signature) and MLflow's
tensorflow pyfunc (which calls the loaded module) both serve it without Keras."""

from __future__ import annotations

import numpy as np
import tensorflow as tf


class ServingModule(tf.Module):
    def __init__(self, model, input_spec: tf.TensorSpec):
        super().__init__(name="serving")
        self.model = model  # tracked, so its variables are saved with the module
        self.__call__ = tf.function(lambda inputs: self.model(inputs, training=False), input_signature=[input_spec])


def serving_module(model, input_example: np.ndarray) -> ServingModule:
    """The serving module of `model` for inputs shaped like `input_example` (any batch size)."""
    spec = tf.TensorSpec([None, *input_example.shape[1:]], tf.as_dtype(input_example.dtype), name="inputs")
    return ServingModule(model, spec)
