"""A model definition that forgot optimizer()."""

from torch import nn


def model():
    return nn.Linear(64, 10)


def loss(outputs, labels):
    return nn.functional.cross_entropy(outputs, labels)
