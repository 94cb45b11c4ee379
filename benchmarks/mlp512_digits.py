"""The MLP the goodput and small-model throughput figures use: 64 -> 512 -> 512 -> 10 on the
digits data, about 300k parameters (a 1.2 MB gradient, inside the worker's direct exchange). A
step of a few milliseconds, so per-step overhead shows beside plain DDP."""

import torch
from torch import nn

from elastic_step.model_zoo.digits_torch import feed, loss, optimizer  # noqa: F401  (same data, loss and optimizer)


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
