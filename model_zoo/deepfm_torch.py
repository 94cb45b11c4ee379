"""DeepFM (Guo et al., 2017) in PyTorch for click logs shaped like Criteo's: 13 dense counts
`I1..I13` and 26 categorical fields `C1..C26`, as `prepare-data --source synthetic:criteo?rows=N
--categorical auto` prepares them (data/synthetic_ctr.py).

Every field's ids live in one table (ConcatWithOffset), each id with a first-order weight and an
8-dim factor. The dense counts enter as log1p(count) with a missing indicator, through a linear
term and as one more FM field. The output is the click logit, one per row.

The feed and the metrics are `ctr_features`' (shared with `deepfm_keras`). Here the tables train
data-parallel, as dense weights: each worker holds them whole and their gradients are summed like
any other.
"""

import torch
from torch import nn

from elastic_step.model_zoo.ctr_features import DENSE, FACTORS, SPARSE, feed, metrics  # noqa: F401 (the contract)


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
