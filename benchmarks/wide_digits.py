"""A wide MLP on the digits data for the throughput benchmark: 8.6 million parameters, so each
step's gradient is 34 MB (float32), above the worker's 16 MiB direct-exchange limit: the step is
a ring allreduce, as for the large models the engine is for."""

import torch
from torch import nn

from elastic_step.model_zoo.digits_torch import feed, loss  # noqa: F401  (same data and loss)


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 2048), nn.ReLU(), nn.Linear(2048, 4096), nn.ReLU(), nn.Linear(4096, 10))


def optimizer(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
