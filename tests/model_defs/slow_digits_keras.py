"""The model-zoo Keras digits model, 20 ms slower per training step so that a test can kill
workers while the job is still running. With ELASTIC_STEP_TEST_WEIGHTS_DIR set, every training
step of every worker also appends `<optimizer iteration> <digest of the weights> <time>` to
`<dir>/<worker id>-<pid>.txt`, so a test can compare the ranks' weights at the same step (the
worker's warm-up step, rolled back before it calls in ready, is recorded too)."""

import hashlib
import os
import time

import numpy as np
import tensorflow as tf

from elastic_step.model_zoo import digits_keras
from elastic_step.model_zoo.digits_keras import feed, metrics  # noqa: F401

built = {}


def model():
    built["model"] = digits_keras.model()
    return built["model"]


def optimizer(net):
    built["optimizer"] = digits_keras.optimizer(net)
    return built["optimizer"]


def _training_step_hook():
    time.sleep(0.02)
    out_dir = os.environ.get("ELASTIC_STEP_TEST_WEIGHTS_DIR")
    if out_dir:
        weights = np.concatenate([np.asarray(w).ravel() for w in built["model"].get_weights()])
        digest = hashlib.sha1(weights.tobytes()).hexdigest()
        with open(os.path.join(out_dir, f"{os.environ['ELASTIC_STEP_WORKER_ID']}-{os.getpid()}.txt"), "a") as f:
            f.write(f"{int(built['optimizer'].iterations.numpy())} {digest} {time.time()}\n")
    return np.float32(0.0)


def loss(outputs, labels):
    value = digits_keras.loss(outputs, labels)
    if not tf.executing_eagerly():  # inside the traced training step; evaluation runs eagerly
        # A Python call at every run of the traced step (a plain call would run once, when traced).
        value = value + tf.py_function(_training_step_hook, [], tf.float32)
    return value
