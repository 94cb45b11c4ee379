"""`train --mode ps` with a Keras model: the Keras PsEmbedding layer (ps/keras_embedding.py) puts
its table on the shards as the PyTorch module does, sharing its pull, dedup and per-id merge
(ps/embedding.py).

Unit level: in a traced (tf.function) step, as the Keras trainer runs it, the layer pulls each
distinct id once and notes the gradient merged per id that a plain gather of the same rows gets;
its one weight, the gradient sink, gets 0; once frozen it looks ids up in the trained table; a
table held by one model is saved with its .keras file and its SavedModel, and is no weight.

End to end (tests/test_ps_pipeline.py): the training pipeline with the Keras DeepFM on two
workers and two shards, each embedding row updated once per minibatch, with the PyTorch
DeepFM's ids; its logged and exported models predict with the trained table.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from elastic_step.ps.embedding import freeze_tables
from elastic_step.ps.keras_embedding import PsEmbedding


def one_table_model(table: PsEmbedding, fields: int = 3) -> keras.Model:
    ids = keras.Input(shape=(fields,), dtype="int64")
    return keras.Model(ids, table(ids))


def test_a_traced_step_pulls_each_id_once_and_notes_the_gradient_merged_per_id():
    reference = np.random.default_rng(0).normal(size=(50, 4)).astype(np.float32)
    pulls = []
    table = PsEmbedding("keras_t", 4)
    table.ps_table.source = lambda ids: pulls.append(ids.copy()) or reference[ids]
    model = one_table_model(table)
    ids = np.array([[3, 7, 3], [49, 7, 0]])
    weights = np.random.default_rng(1).normal(size=(2, 3, 4)).astype(np.float32)

    @tf.function
    def step(ids, weights):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(ids, training=True) * weights)
        return tape.gradient(loss, model.trainable_variables)

    sink_gradient, = step(tf.constant(ids), tf.constant(weights))
    assert [v.name for v in model.trainable_variables] == ["ps_gradient_sink"] and float(sink_gradient) == 0.0
    assert [p.tolist() for p in pulls] == [[3, 7, 49, 0]]  # each distinct id pulled once, in order of appearance
    got_ids, grads = table.take_gradients()
    expected = np.zeros_like(reference)
    np.add.at(expected, ids.reshape(-1), weights.reshape(-1, 4))  # a gather's gradient, summed per id
    assert got_ids.tolist() == [3, 7, 49, 0]
    np.testing.assert_allclose(grads, expected[got_ids], rtol=1e-6)
    assert table.take_gradients() is None  # taken once
    np.testing.assert_allclose(model(ids, training=False), reference[ids])  # inference pulls too, notes nothing
    assert table.take_gradients() is None


def test_a_frozen_table_serves_its_rows_and_zeros_for_ids_it_never_trained():
    table = PsEmbedding("keras_frozen_t", 2)
    model = one_table_model(table, fields=2)
    with pytest.raises(Exception, match="lives on parameter-server shards"):
        model(np.array([[1, 2]]), training=True)  # neither pulled from shards nor frozen: no training
    freeze_tables({"keras_frozen_t": (np.array([10, 2, 7]), np.array([[1, 1], [2, 2], [3, 3]], np.float32))})
    np.testing.assert_allclose(model.predict(np.array([[7, 2], [10, 5]]), verbose=0), [[[3, 3], [2, 2]], [[1, 1], [0, 0]]])


def test_a_held_table_is_saved_with_the_keras_file_and_the_savedmodel_but_is_no_weight(tmp_path):
    """What the logged model (a .keras file) and the exported one (a SavedModel) hold: the
    table given to this model only (the release steps' hold_tables), looked up with TensorFlow
    ops alone, while the model's weights (the workers' model bytes) stay the sink."""
    from elastic_step.frameworks.keras_serving import serving_module
    from elastic_step.ps.embedding import hold_tables

    table = PsEmbedding("keras_held_t", 2)
    model, other = one_table_model(table, fields=2), one_table_model(PsEmbedding("keras_held_t", 2), fields=2)
    hold_tables(model, {"keras_held_t": (np.array([10, 2, 7]), np.array([[1, 1, 9], [2, 2, 9], [3, 3, 9]], np.float32))})
    ids = np.array([[7, 2], [10, 5]])
    expected = [[[3, 3], [2, 2]], [[1, 1], [0, 0]]]  # the row cut to the table's dim; zeros for an id never trained
    np.testing.assert_allclose(model.predict(ids, verbose=0), expected)
    assert [w.name for w in model.weights] == ["ps_gradient_sink"]
    assert other.layers[-1].held_ids is None  # another model of the same table (the champion beside a candidate)

    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")  # nothing frozen in this process for this table
    np.testing.assert_allclose(loaded.predict(ids, verbose=0), expected)
    assert [w.name for w in loaded.weights] == ["ps_gradient_sink"]

    module = serving_module(model, ids)
    tf.saved_model.save(module, str(tmp_path / "saved"), signatures={"serving_default": module.__call__})
    graph = module.__call__.get_concrete_function().graph
    assert not [op.type for op in graph.get_operations() if "PyFunc" in op.type]  # a SavedModel serves it anywhere
    served = tf.saved_model.load(str(tmp_path / "saved")).signatures["serving_default"]
    np.testing.assert_allclose(next(iter(served(inputs=tf.constant(ids)).values())), expected)
