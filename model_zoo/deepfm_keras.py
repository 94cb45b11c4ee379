"""DeepFM in Keras 3 (TensorFlow backend): the network, loss, feed and metrics of `deepfm_torch`,
for click logs shaped like Criteo's (`prepare-data --source synthetic:criteo?rows=N --categorical
auto`). The feed and the metrics are `ctr_features`', so both front ends get the same ids and
features.
"""

import keras

from elastic_step.model_zoo.ctr_features import DENSE, FACTORS, SPARSE, feed, metrics  # noqa: F401 (the contract)


class _Split(keras.layers.Layer):
    """The packed input (ids beside dense features, as `feed` packs them) as (ids, dense)."""

    def __init__(self, fields: int, **kwargs):
        super().__init__(**kwargs)
        self.fields = fields

    def call(self, packed):
        return keras.ops.cast(packed[:, :self.fields], "int32"), keras.ops.cast(packed[:, self.fields:], "float32")


def model() -> keras.Model:
    fields, dense_width = len(SPARSE.columns), 2 * len(DENSE)
    packed = keras.Input(shape=(fields + dense_width,), dtype="float64")
    ids, dense = _Split(fields)(packed)
    init = keras.initializers.RandomNormal(stddev=0.01)
    first_order = keras.layers.Embedding(SPARSE.num_ids, 1, embeddings_initializer=init)(ids)  # [rows, F, 1]
    factors = keras.layers.Embedding(SPARSE.num_ids, FACTORS, embeddings_initializer=init)(ids)  # [rows, F, k]
    return keras.Model(packed, fm_and_deep(keras.ops.sum(first_order, axis=(1, 2)), factors, dense))


def fm_and_deep(first_order, factors, dense):
    """DeepFM's logits from the fields' summed first-order weights [rows], their factors
    [rows, F, k] and the dense features: first order + pairwise interactions + the deep part, the
    dense features as one more field. Shared with `deepfm_ps_keras`, whose rows come from the shards."""
    dense_factor = keras.layers.Reshape((1, FACTORS))(keras.layers.Dense(FACTORS)(dense))
    all_fields = keras.layers.Concatenate(axis=1)([factors, dense_factor])  # [rows, F+1, k]
    summed = keras.ops.sum(all_fields, axis=1)
    pairwise = 0.5 * keras.ops.sum(summed * summed - keras.ops.sum(all_fields * all_fields, axis=1), axis=1)
    first = first_order + keras.ops.squeeze(keras.layers.Dense(1)(dense), axis=1)
    deep = keras.layers.Flatten()(all_fields)
    deep = keras.layers.Dense(128, activation="relu")(deep)
    deep = keras.layers.Dense(64, activation="relu")(deep)
    deep = keras.ops.squeeze(keras.layers.Dense(1)(deep), axis=1)
    return first + pairwise + deep


def loss(outputs, labels):
    """Mean binary cross-entropy of the click logits."""
    return keras.ops.mean(keras.losses.binary_crossentropy(keras.ops.cast(labels, "float32"), outputs, from_logits=True))


def optimizer(model: keras.Model) -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(learning_rate=2e-3)
