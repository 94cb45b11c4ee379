"""A model definition whose loss becomes NaN after a few steps (for the NaN-loss test)."""

import torch
from torch import nn

from elastic_step.model_zoo.digits_torch import feed  # noqa: F401  (same data as the zoo model)

calls = 0


def model():
    return nn.Linear(64, 10)


def loss(outputs, labels):
    global calls
    calls += 1
    value = nn.functional.cross_entropy(outputs, labels)
    return value * float("nan") if calls > 5 else value


def optimizer(net):
    return torch.optim.SGD(net.parameters(), lr=0.1)
