"""DeepFM (Guo et al., 2017) in PyTorch with its embedding table on parameter-server shards:
`elastic-step train --mode ps --ps-shards N --model-def elastic_step.model_zoo.deepfm_ps_torch`.

The same model as `deepfm_torch` on the same feed (`ctr_features`), except where the table lives:
every field's ids (ConcatWithOffset) index one PsEmbedding table whose row is [first-order
weight | 8-dim factor], trained on the shards with Adagrad (the shard's per-row optimizer; the
table is never on a worker whole). The dense weights (the dense features' terms and the MLP)
stay on the workers and train with Adam by allreduce.
"""

import torch
from torch import nn

from elastic_step.model_zoo.ctr_features import DENSE, FACTORS, SPARSE, feed, metrics  # noqa: F401 (the contract)
from elastic_step.ps.torch_embedding import PsEmbedding

TABLE = "deepfm_ids"
TABLE_LR = 0.05  # Adagrad's rate on the shards


class DeepFM(nn.Module):
    def __init__(self, fields: int, dense: int, rows: int = 0):
        super().__init__()
        self.fields = fields
        # rows: the table's size (every field's ids side by side); the shards reserve it up front
        self.table = PsEmbedding(TABLE, 1 + FACTORS, optimizer="adagrad", lr=TABLE_LR, init_scale=0.01, rows=rows)
        self.dense_linear = nn.Linear(dense, 1)
        self.dense_factor = nn.Linear(dense, FACTORS)  # the dense features as one more FM field
        self.deep = nn.Sequential(nn.Linear((fields + 1) * FACTORS, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                                  nn.Linear(64, 1))

    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        ids = packed[:, :self.fields].long()
        dense = packed[:, self.fields:].float()
        rows = self.table(ids)  # [rows, F, 1 + k]
        fields = torch.cat([rows[:, :, 1:], self.dense_factor(dense).unsqueeze(1)], dim=1)  # [rows, F+1, k]
        pairwise = 0.5 * (fields.sum(dim=1).pow(2) - fields.pow(2).sum(dim=1)).sum(dim=1)
        first = rows[:, :, 0].sum(dim=1) + self.dense_linear(dense).squeeze(1)
        return first + pairwise + self.deep(fields.flatten(1)).squeeze(1)


def model() -> nn.Module:
    return DeepFM(len(SPARSE.columns), 2 * len(DENSE), rows=SPARSE.num_ids)


def loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(outputs, labels.float())


def optimizer(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(net.parameters(), lr=2e-3)
