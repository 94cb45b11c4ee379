"""Per-row optimizer updates, applied by a shard to the rows a push touched.

A row's storage is one float32 line: [weights | slot 1 | slot 2], each `dim` wide (table.py).
The rules are torch.optim's (SGD, Adagrad, Adam without weight decay or amsgrad) so that a
model trained against the shards behaves as the same model trained in one process. Adam is
*lazy*: a row's bias correction counts that row's own updates (`steps`), as TensorFlow's
LazyAdam and torch's SparseAdam do, because an untouched row has no gradient to decay.
"""

from __future__ import annotations

import numpy as np

from elastic_step.ps.api import OptimizerKind, TableSpec


def apply_rows(spec: TableSpec, rows: np.ndarray, grads: np.ndarray, steps: np.ndarray) -> None:
    """Update `rows` (k x width, in place) with `grads` (k x dim); `steps` is each row's update
    count including this one (1 for a row's first update)."""
    dim = spec.dim
    weights = rows[:, :dim]
    if spec.optimizer is OptimizerKind.SGD:
        weights -= np.float32(spec.lr) * grads
    elif spec.optimizer is OptimizerKind.ADAGRAD:
        accumulator = rows[:, dim : 2 * dim]
        accumulator += grads * grads
        weights -= np.float32(spec.lr) * grads / (np.sqrt(accumulator) + np.float32(spec.eps))
    else:
        _adam(spec, rows, grads, steps)


def _adam(spec: TableSpec, rows: np.ndarray, grads: np.ndarray, steps: np.ndarray) -> None:
    dim = spec.dim
    weights, first, second = rows[:, :dim], rows[:, dim : 2 * dim], rows[:, 2 * dim : 3 * dim]
    first += np.float32(1 - spec.beta1) * (grads - first)
    second *= np.float32(spec.beta2)
    second += np.float32(1 - spec.beta2) * grads * grads
    t = steps.astype(np.float64)[:, None]
    step_size = (spec.lr / (1 - spec.beta1**t)).astype(np.float32)
    bias2_sqrt = np.sqrt(1 - spec.beta2**t).astype(np.float32)
    weights -= step_size * first / (np.sqrt(second) / bias2_sqrt + np.float32(spec.eps))


def initial_slots(spec: TableSpec, count: int) -> np.ndarray:
    """The optimizer slots of `count` new rows (count x slots*dim)."""
    slots = np.zeros((count, spec.dim * (1 if spec.optimizer is OptimizerKind.ADAGRAD else 0)), np.float32)
    if spec.optimizer is OptimizerKind.ADAGRAD:
        slots[:] = spec.initial_accumulator
    elif spec.optimizer is OptimizerKind.ADAM:
        slots = np.zeros((count, 2 * spec.dim), np.float32)
    return slots
