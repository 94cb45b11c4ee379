"""DeepFM (Guo et al., 2017) in PyTorch for click logs shaped like Criteo's: 13 dense counts
`I1..I13` and 26 categorical fields `C1..C26`, as `prepare-data --source synthetic:criteo?rows=N
--categorical auto` prepares them (data/synthetic_ctr.py).

Every field's ids live in one table (ConcatWithOffset), each id with a first-order weight and an
8-dim factor. The dense counts enter as log1p(count) with a missing indicator, through a linear
term and as one more FM field. The output is the click logit, one per row.

The engine's feed hands the model one array, so `feed` packs the ids and the dense features side
by side in float64 (exact for ids below 2^53) and `forward` splits them again. Here the tables
train data-parallel, as dense weights: each worker holds them whole and their gradients are
summed like any other.
"""

import numpy as np
import torch
from torch import nn

from elastic_step.data.categorical_features import SparseFeatures

DENSE = [f"I{i}" for i in range(1, 14)]
SPARSE = SparseFeatures(*[f"C{i}" for i in range(1, 27)])
FACTORS = 8


class DeepFM(nn.Module):
    def __init__(self, num_ids: int, fields: int, dense: int):
        super().__init__()
        self.fields = fields
        self.first_order = nn.Embedding(num_ids, 1)
        self.factors = nn.Embedding(num_ids, FACTORS)
        nn.init.normal_(self.first_order.weight, std=0.01)
        nn.init.normal_(self.factors.weight, std=0.01)
        self.dense_linear = nn.Linear(dense, 1)
        self.dense_factor = nn.Linear(dense, FACTORS)  # the dense features as one more FM field
        self.deep = nn.Sequential(nn.Linear((fields + 1) * FACTORS, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                                  nn.Linear(64, 1))

    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        ids = packed[:, :self.fields].long()
        dense = packed[:, self.fields:].float()
        fields = torch.cat([self.factors(ids), self.dense_factor(dense).unsqueeze(1)], dim=1)  # [rows, F+1, k]
        pairwise = 0.5 * (fields.sum(dim=1).pow(2) - fields.pow(2).sum(dim=1)).sum(dim=1)
        first = self.first_order(ids).sum(dim=(1, 2)) + self.dense_linear(dense).squeeze(1)
        return first + pairwise + self.deep(fields.flatten(1)).squeeze(1)


def model() -> nn.Module:
    return DeepFM(SPARSE.num_ids, len(SPARSE.columns), 2 * len(DENSE))


def loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(outputs, labels.float())


def optimizer(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(net.parameters(), lr=2e-3)


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
