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

The table is not a weight: the workers' model bytes and checkpoints never hold it. Once the
layer is given the trained table (in the master when the shards stop, embedding.freeze_tables; in
the release steps from the run's table file, embedding.hold_tables) it looks ids up in it with
TensorFlow ops alone (searchsorted and gather over two TensorFlow variables that are not Keras
weights, so the model's weights and state stay the workers'): a SavedModel of the model holds the
table and serves without this module, and the layer's `.keras` file (the model logged to MLflow)
saves and loads the table beside its sink, so the logged model predicts with the trained table in
any process.
"""

from __future__ import annotations

import weakref
from functools import partial

import keras
import numpy as np
import tensorflow as tf

from elastic_step.ps.api import OptimizerKind, TableSpec
from elastic_step.ps.embedding import TableRows, frozen_table, held_or_placeholder, on_freeze

HELD_IDS, HELD_ROWS = "held_ids", "held_rows"  # the trained table's entries in the layer's saved variables

_INSTANCES: weakref.WeakSet = weakref.WeakSet()  # every PsEmbedding layer of this process, for freeze_tables


def _adopt_all() -> None:
    for layer in list(_INSTANCES):
        layer._adopt_frozen()


on_freeze(_adopt_all)


@keras.saving.register_keras_serializable(package="elastic_step")
class PsEmbedding(keras.layers.Layer):
    def __init__(self, table: str, dim: int, optimizer: str = "adagrad", lr: float = 0.01, seed: int = 0,
                 init_scale: float = 0.05, rows: int = 0, **kwargs):
        super().__init__(**kwargs)  # rows: the table's declared size (torch_embedding.PsEmbedding says more)
        self.ps_table = TableRows(TableSpec(table, dim, OptimizerKind(optimizer), lr=lr, seed=seed, init_scale=init_scale,
                                            rows=rows))
        self.held_ids = self.held_rows = None  # the trained table, once held (TensorFlow variables)
        _INSTANCES.add(self)
        self._adopt_frozen()

    @property
    def spec(self) -> TableSpec:
        return self.ps_table.spec

    def build(self, input_shape):
        self.sink = self.add_weight(shape=(), initializer="zeros", trainable=True, name="ps_gradient_sink")

    def compute_output_shape(self, input_shape):
        return (*input_shape, self.spec.dim)

    def _adopt_frozen(self) -> None:
        table = frozen_table(self.spec.name)
        if table is not None:
            self.hold_table(*table)

    def hold_table(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Look ids up in this trained table from now on (embedding.hold_tables)."""
        ids, rows = held_or_placeholder(*self.ps_table.hold(ids, rows))
        # Plain TensorFlow variables: a SavedModel of the model tracks and saves them; Keras does not
        # count them among the layer's weights (the workers' model bytes and checkpoints).
        self.held_ids = tf.Variable(ids, trainable=False, name="ps_held_ids")
        self.held_rows = tf.Variable(rows, trainable=False, name="ps_held_rows")

    def call(self, ids, training=None):
        ids = tf.cast(ids, tf.int64)
        if self.held_ids is not None and self.ps_table.source is None:
            return self._held_lookup(ids)
        unique, inverse, rows = tf.numpy_function(partial(self._rows, bool(training)), [ids],
                                                  [tf.int64, tf.int64, tf.float32], stateful=True)
        rows = tf.ensure_shape(rows, [None, self.spec.dim])
        if training:
            rows = self._noting(rows, unique, tf.identity(self.sink.value))
        found = tf.gather(rows, tf.ensure_shape(inverse, [None]))
        out = tf.reshape(found, tf.concat([tf.shape(ids, out_type=tf.int32), [self.spec.dim]], axis=0))
        out.set_shape(ids.shape.concatenate([self.spec.dim]))
        return out

    def _held_lookup(self, ids):
        """TensorFlow ops only (a SavedModel serves them): each id's row, zeros for an id never trained."""
        flat = tf.reshape(ids, [-1])
        last = tf.size(self.held_ids, out_type=tf.int64) - 1
        positions = tf.minimum(tf.searchsorted(self.held_ids, flat, out_type=tf.int64), last)
        held = tf.cast(tf.equal(tf.gather(self.held_ids, positions), flat), tf.float32)
        found = tf.gather(self.held_rows, positions) * held[:, None]
        out = tf.reshape(found, tf.concat([tf.shape(ids, out_type=tf.int32), [self.spec.dim]], axis=0))
        out.set_shape(ids.shape.concatenate([self.spec.dim]))
        return out

    def save_own_variables(self, store) -> None:
        """The sink, and the trained table once held: the layer's part of a `.keras` file."""
        super().save_own_variables(store)
        if self.held_ids is not None:
            store[HELD_IDS], store[HELD_ROWS] = self.held_ids.numpy(), self.held_rows.numpy()

    def load_own_variables(self, store) -> None:
        self.sink.assign(store["0"])
        if HELD_IDS in store:
            self.hold_table(np.asarray(store[HELD_IDS]), np.asarray(store[HELD_ROWS]))

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
                "lr": spec.lr, "seed": spec.seed, "init_scale": spec.init_scale, "rows": spec.rows}
