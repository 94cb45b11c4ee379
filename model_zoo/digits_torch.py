"""A small PyTorch MLP for the bundled digits data (8x8 images, 10 classes).

Used by the demo, the tests and the benchmarks. Pixel values are 0..16; `feed` scales them.
"""

import numpy as np
import torch
from torch import nn

FEATURES = [f"pixel_{i}" for i in range(64)]


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(outputs, labels)


def optimizer(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(net.parameters(), lr=3e-3)


def feed(batch: dict) -> tuple[np.ndarray, np.ndarray]:
    features = np.column_stack([batch[name] for name in FEATURES]).astype(np.float32) / 16.0
    return features, batch["label"].astype(np.int64)


def metrics() -> dict:
    """Extra evaluation metrics: name -> f(outputs, labels) on numpy arrays."""
    return {"error_rate": lambda outputs, labels: float((outputs.argmax(axis=1) != labels).mean())}
