"""The model-zoo digits model, made 20 ms slower per step so that a test can scale, stop or
kill workers while the job is still running, on any machine."""

import time

from elastic_step.model_zoo.digits_torch import feed, metrics, model, optimizer  # noqa: F401
from elastic_step.model_zoo.digits_torch import loss as zoo_loss


def loss(outputs, labels):
    if outputs.requires_grad:  # training steps only; evaluation stays fast
        time.sleep(0.02)
    return zoo_loss(outputs, labels)
