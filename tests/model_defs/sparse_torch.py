"""A small PyTorch model over categorical features: the CSV of tests/test_categorical.py
(`site`, `device`, `age` as ids through the manifest's specs, `x` as a number). Its twin
`sparse_keras.py` declares the same sparse features and must feed the same ids."""

import numpy as np
import torch
from torch import nn

from elastic_step.data.categorical_features import SparseFeatures

SPARSE = SparseFeatures("site", "device", "age")
DIM = 4


class Net(nn.Module):
    def __init__(self, num_ids: int, fields: int):
        super().__init__()
        self.fields = fields
        self.table = nn.Embedding(num_ids, DIM)  # one table for every field (ConcatWithOffset)
        self.out = nn.Linear(fields * DIM + 1, 2)

    def forward(self, features):
        ids = features[:, : self.fields].long()
        dense = features[:, self.fields:].float()
        return self.out(torch.cat([self.table(ids).flatten(1), dense], dim=1))


def model() -> nn.Module:
    return Net(SPARSE.num_ids, len(SPARSE.columns))


def loss(outputs, labels):
    return nn.functional.cross_entropy(outputs, labels)


def optimizer(net):
    return torch.optim.Adagrad(net.parameters(), lr=0.05)


def feed(batch: dict):
    # Ids and the number in one float64 array: ids below 2^53 are exact in it.
    features = np.column_stack([SPARSE.ids(batch), batch["x"]]).astype(np.float64)
    return features, batch["label"].astype(np.int64)
