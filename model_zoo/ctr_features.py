"""What both DeepFM model definitions share, in numpy only: the columns, the feed that turns a
batch of a Criteo-shaped click log into ids and dense features, and the gate's metrics.

The engine's feed hands the model one array, so `feed` packs the ids and the dense features side
by side in float64 (exact for ids below 2^53) and each model splits them again.
"""

import numpy as np

from elastic_step.data.categorical_features import SparseFeatures

DENSE = [f"I{i}" for i in range(1, 14)]
SPARSE = SparseFeatures(*[f"C{i}" for i in range(1, 27)])
FACTORS = 8


def feed(batch: dict) -> tuple[np.ndarray, np.ndarray]:
    counts = np.column_stack([batch[name] for name in DENSE]).astype(np.float64)
    missing = counts < 0  # Criteo's missing counts, filled with -1
    dense = np.concatenate([np.log1p(np.where(missing, 0.0, counts)), missing], axis=1)
    packed = np.concatenate([SPARSE.ids(batch).astype(np.float64), dense], axis=1)
    return packed, batch["label"].astype(np.int64)


def _probabilities(outputs: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-outputs.astype(np.float64)))


def auc(outputs: np.ndarray, labels: np.ndarray) -> float:
    """The area under the ROC curve: the chance that a click is ranked above a non-click (ties
    count half), by the rank-sum formula."""
    from scipy.stats import rankdata

    ranks = rankdata(outputs)  # ties get their average rank
    positives = labels == 1
    n_pos, n_neg = int(positives.sum()), int((~positives).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((ranks[positives].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def log_loss(outputs: np.ndarray, labels: np.ndarray) -> float:
    p = np.clip(_probabilities(outputs), 1e-7, 1 - 1e-7)
    return float(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))


def metrics() -> dict:
    """The gate's metrics for click models: AUC (higher is better) and log loss (lower)."""
    return {"auc": auc, "log_loss": log_loss}
