"""The Keras twin of sparse_torch.py: the same sparse features through the same numpy layers
(Keras' own Hashing and StringLookup need TensorFlow and would not run on the torch backend)."""

import keras
import numpy as np

from elastic_step.data.categorical_features import SparseFeatures

SPARSE = SparseFeatures("site", "device", "age")
DIM = 4


def model() -> keras.Model:
    fields = len(SPARSE.columns)
    inputs = keras.Input(shape=(fields + 1,), dtype="float64")
    ids = keras.ops.cast(inputs[:, :fields], "int32")
    embedded = keras.layers.Flatten()(keras.layers.Embedding(SPARSE.num_ids, DIM)(ids))
    dense = keras.ops.cast(inputs[:, fields:], "float32")
    outputs = keras.layers.Dense(2)(keras.layers.Concatenate()([embedded, dense]))
    return keras.Model(inputs, outputs)


def loss(outputs, labels):
    return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True))


def optimizer(model):
    return keras.optimizers.Adagrad(learning_rate=0.05)


def feed(batch: dict):
    features = np.column_stack([SPARSE.ids(batch), batch["x"]]).astype(np.float64)
    return features, batch["label"].astype(np.int64)
