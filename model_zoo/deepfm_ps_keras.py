"""DeepFM in Keras 3 with its embedding table on parameter-server shards:
`elastic-step train --mode ps --ps-shards N --model-def elastic_step.model_zoo.deepfm_ps_keras`.

The twin of `deepfm_ps_torch`: the same feed and ids (`ctr_features`), the same table (every
field's ids index one table named `deepfm_ids` whose row is [first-order weight | 8-dim factor],
trained on the shards with Adagrad), the same network around it. The dense weights stay on the
workers and train with Adam by allreduce.
"""

import keras

from elastic_step.model_zoo.ctr_features import DENSE, FACTORS, SPARSE, feed, metrics  # noqa: F401 (the contract)
from elastic_step.ps.keras_embedding import PsEmbedding

TABLE = "deepfm_ids"
TABLE_LR = 0.05  # Adagrad's rate on the shards


@keras.saving.register_keras_serializable(package="elastic_step.deepfm_ps_keras")  # the logged model loads
class _Split(keras.layers.Layer):
    """The packed input (ids beside dense features, as `feed` packs them) as (ids, dense)."""

    def __init__(self, fields: int, **kwargs):
        super().__init__(**kwargs)
        self.fields = fields

    def call(self, packed):
        return keras.ops.cast(packed[:, :self.fields], "int64"), keras.ops.cast(packed[:, self.fields:], "float32")

    def get_config(self) -> dict:
        return {**super().get_config(), "fields": self.fields}


def model() -> keras.Model:
    fields, dense_width = len(SPARSE.columns), 2 * len(DENSE)
    packed = keras.Input(shape=(fields + dense_width,), dtype="float64")
    ids, dense = _Split(fields)(packed)
    rows = PsEmbedding(TABLE, 1 + FACTORS, optimizer="adagrad", lr=TABLE_LR, init_scale=0.01)(ids)  # [rows, F, 1 + k]
    dense_factor = keras.layers.Reshape((1, FACTORS))(keras.layers.Dense(FACTORS)(dense))
    all_fields = keras.layers.Concatenate(axis=1)([rows[:, :, 1:], dense_factor])  # [rows, F+1, k]
    summed = keras.ops.sum(all_fields, axis=1)
    pairwise = 0.5 * keras.ops.sum(summed * summed - keras.ops.sum(all_fields * all_fields, axis=1), axis=1)
    first = keras.ops.sum(rows[:, :, 0], axis=1) + keras.ops.squeeze(keras.layers.Dense(1)(dense), axis=1)
    deep = keras.layers.Flatten()(all_fields)
    deep = keras.layers.Dense(128, activation="relu")(deep)
    deep = keras.layers.Dense(64, activation="relu")(deep)
    deep = keras.ops.squeeze(keras.layers.Dense(1)(deep), axis=1)
    return keras.Model(packed, first + pairwise + deep)


def loss(outputs, labels):
    """Mean binary cross-entropy of the click logits."""
    return keras.ops.mean(keras.losses.binary_crossentropy(keras.ops.cast(labels, "float32"), outputs, from_logits=True))


def optimizer(model: keras.Model) -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(learning_rate=2e-3)
