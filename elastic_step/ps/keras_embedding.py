"""PsEmbedding for Keras 3 (TensorFlow backend, as frameworks/keras_trainer.py runs Keras): a layer
whose table lives on the parameter-server shards, the twin of torch_embedding.PsEmbedding. Where
its rows come from, the batch's distinct ids and the gradients merged per id are embedding.py's,
shared with the PyTorch module; this layer adds TensorFlow's side.

The trainer traces the forward and backward pass into one graph (tf.function), so the pull is a
`tf.numpy_function` in the graph: it dedups the batch's ids and pulls their rows (from the shards
on a worker, the live shards or the frozen table in the master). The rows are not a variable, so
the gradient tape would never differentiate towards them: they pass through an identity whose
custom gradient notes the rows' gradient (the batch's gradient merged per distinct id, as the
tape sums a gather's slices) for the training step to push, and flows on into the layer's one
scalar weight, the *sink*, as 0. The sink is what makes the tape reach the identity; its gradient
is always 0, so its optimizer leaves it at 0.

The table is not a weight: the workers' model bytes and checkpoints never hold it. The logged
Keras model holds the dense weights; in the master, once the shards have stopped, its lookups
use the frozen table (embedding.freeze_tables) for the test-set evaluation.
"""

from __future__ import annotations

from functools import partial

import keras
import numpy as np
import tensorflow as tf

from elastic_step.ps.api import OptimizerKind, TableSpec
from elastic_step.ps.embedding import TableRows


@keras.saving.register_keras_serializable(package="elastic_step")
class PsEmbedding(keras.layers.Layer):
    def __init__(self, table: str, dim: int, optimizer: str = "adagrad", lr: float = 0.01, seed: int = 0,
                 init_scale: float = 0.05, **kwargs):
        super().__init__(**kwargs)
        self.ps_table = TableRows(TableSpec(table, dim, OptimizerKind(optimizer), lr=lr, seed=seed, init_scale=init_scale))

    @property
    def spec(self) -> TableSpec:
        return self.ps_table.spec

    def build(self, input_shape):
        self.sink = self.add_weight(shape=(), initializer="zeros", trainable=True, name="ps_gradient_sink")

    def compute_output_shape(self, input_shape):
        return (*input_shape, self.spec.dim)

    def call(self, ids, training=None):
        ids = tf.cast(ids, tf.int64)
        unique, inverse, rows = tf.numpy_function(partial(self._rows, bool(training)), [ids],
                                                  [tf.int64, tf.int64, tf.float32], stateful=True)
        rows = tf.ensure_shape(rows, [None, self.spec.dim])
        if training:
            rows = self._noting(rows, unique, tf.identity(self.sink.value))
        found = tf.gather(rows, tf.ensure_shape(inverse, [None]))
        out = tf.reshape(found, tf.concat([tf.shape(ids, out_type=tf.int32), [self.spec.dim]], axis=0))
        out.set_shape(ids.shape.concatenate([self.spec.dim]))
        return out

    def _rows(self, training: bool, ids: np.ndarray):
        unique, inverse, rows = self.ps_table.distinct(ids, training)
        return unique, inverse.astype(np.int64, copy=False), rows

    def _noting(self, rows, unique, sink):
        @tf.custom_gradient
        def noted(rows, sink):
            def gradient(upstream):
                merged = tf.convert_to_tensor(upstream)  # a gather's slices, summed per distinct id
                done = tf.numpy_function(self._note, [unique, merged], tf.float32, stateful=True)
                return tf.zeros_like(rows), tf.reshape(done, [])  # nothing flows into the pull; 0 to the sink
            return tf.identity(rows), gradient

        return noted(rows, sink)

    def _note(self, unique: np.ndarray, gradient: np.ndarray) -> np.float32:
        self.ps_table.note(unique.copy(), gradient.astype(np.float32, copy=True))
        return np.float32(0.0)

    def take_gradients(self) -> tuple[np.ndarray, np.ndarray] | None:
        return self.ps_table.take_gradients()

    def forget(self) -> None:
        self.ps_table.forget()

    def get_config(self) -> dict:
        spec = self.spec
        return {**super().get_config(), "table": spec.name, "dim": spec.dim, "optimizer": str(spec.optimizer),
                "lr": spec.lr, "seed": spec.seed, "init_scale": spec.init_scale}
