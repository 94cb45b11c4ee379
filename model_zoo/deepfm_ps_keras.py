"""DeepFM in Keras 3 with its embedding table on parameter-server shards:
`elastic-step train --mode ps --ps-shards N --model-def elastic_step.model_zoo.deepfm_ps_keras`.

The twin of `deepfm_ps_torch`: the same feed and ids (`ctr_features`), the same table (every
field's ids index one table named `deepfm_ids` whose row is [first-order weight | 8-dim factor],
trained on the shards with Adagrad), the same network around it. The dense weights stay on the
workers and train with Adam by allreduce.
"""

import keras

from elastic_step.model_zoo.ctr_features import DENSE, FACTORS, SPARSE, feed, metrics  # noqa: F401 (the contract)
from elastic_step.model_zoo.deepfm_keras import fm_and_deep, loss, optimizer  # noqa: F401 (the contract)
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
    rows = PsEmbedding(TABLE, 1 + FACTORS, optimizer="adagrad", lr=TABLE_LR, init_scale=0.01,
                       rows=SPARSE.num_ids)(ids)  # [rows, F, 1 + k]; the table's size: the shards reserve it
    return keras.Model(packed, fm_and_deep(keras.ops.sum(rows[:, :, 0], axis=1), rows[:, :, 1:], dense))

