"""A small Keras MLP for the bundled digits data (8x8 images, 10 classes): the same network,
loss, optimizer and feed as `digits_torch`, for TensorFlow 2 / Keras 3.

Used by the tests and the benchmarks. Pixel values are 0..16; `feed` scales them.
"""

import keras
import numpy as np

FEATURES = [f"pixel_{i}" for i in range(64)]


def model() -> keras.Model:
    return keras.Sequential([
        keras.Input(shape=(64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])


def loss(outputs, labels):
    """Mean cross-entropy over the batch (outputs are logits, labels class indices)."""
    return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True))


def optimizer(model: keras.Model) -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(learning_rate=3e-3)


def feed(batch: dict) -> tuple[np.ndarray, np.ndarray]:
    features = np.column_stack([batch[name] for name in FEATURES]).astype(np.float32) / 16.0
    return features, batch["label"].astype(np.int64)


def metrics() -> dict:
    """Extra evaluation metrics: name -> f(outputs, labels) on numpy arrays."""
    return {"error_rate": lambda outputs, labels: float((outputs.argmax(axis=1) != labels).mean())}
