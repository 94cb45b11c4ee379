"""A synthetic click log shaped like Criteo's: the data of the sparse (parameter-server) models.

Criteo's terabyte click logs cannot be bundled, and nothing about them is known exactly, so a
benchmark on them can say how fast a model learns but not how close it came. This generator keeps
Criteo's shape and knows the truth:

- 13 dense columns `I1..I13`: log-normal integer counts, each missing in a fixed 5-40 % of rows
  (written as -1, as Criteo's usual preprocessing fills them: prepare-data refuses nulls);
- 26 categorical columns `C1..C26`: 8 hex characters, as Criteo's hashed values look, with
  cardinalities in the proportions of the Criteo-1TB tables scaled by `scale` (at least 3 each);
  ids are Zipf-distributed, and a fraction `unseen` of the values in any row are fresh ones
  drawn from 2^32 values, so almost none of them recur (unseen at test time);
- `label` (0/1) drawn from the true probability (a column `true_probability` only when asked
  for: as a feature it would give the answer away), the sigmoid of a planted logit: a weight for each
  of a field's `FREQUENT` most frequent values, a dense term, and `INTERACTIONS` pairwise field
  interactions (a dot product of 4-dim factors), which a factorization machine can learn and
  logistic regression cannot. The benchmark reports the gap to the Bayes-optimal log loss.

Rows come in blocks of `BLOCK` rows, each drawn from its own seed (the data seed and the block
index), so any block, and so the exact number of times each id occurs, can be recomputed
without the rest (`value_counts`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Iterator

import numpy as np
import pyarrow as pa

from elastic_step.errors import DataError

# Rows of each table of Criteo-1TB (the 26 categorical features), as the DLRM and TorchRec
# benchmarks list them.
CRITEO_1TB_CARDINALITIES = (
    45833188, 36746, 17245, 7413, 20243, 3, 7114, 1441, 62, 29275261, 1572176, 345138, 10, 2209,
    11267, 128, 4, 974, 14, 48937457, 11316796, 40094537, 452104, 12606, 104, 35)
DENSE = [f"I{i}" for i in range(1, 14)]
CATEGORICAL = [f"C{i}" for i in range(1, 27)]
LABEL = "label"
TRUE_PROBABILITY = "true_probability"
BLOCK = 8192
FREQUENT = 1000  # values per field with a planted weight
INTERACTIONS = ((0, 1), (2, 9), (3, 13), (10, 21))  # field pairs with a planted interaction
ZIPF_EXPONENT = 1.15
MISSING_DENSE = -1.0


@dataclasses.dataclass(frozen=True)
class CtrSpec:
    """What to generate: `rows` rows of data seed `seed`, tables `scale` x Criteo-1TB's."""

    rows: int
    seed: int = 0
    scale: float = 1e-3
    unseen: float = 0.02
    model_seed: int = 1234  # the planted logit: the same for every data seed

    def __post_init__(self):
        if self.rows < 1:
            raise DataError(f"rows={self.rows}: give at least 1 row")
        if not 0 < self.scale <= 1:
            raise DataError(f"scale={self.scale}: give a scale in (0, 1] of Criteo-1TB's tables")
        if not 0 <= self.unseen < 0.5:
            raise DataError(f"unseen={self.unseen}: give a fraction in [0, 0.5)")

    @property
    def cardinalities(self) -> list[int]:
        return [max(3, int(round(c * self.scale))) for c in CRITEO_1TB_CARDINALITIES]


@dataclasses.dataclass
class PlantedLogit:
    """The truth the labels are drawn from (per-value weights, dense weights, interaction factors)."""

    bias: float
    dense: np.ndarray  # [13]
    weights: list[np.ndarray]  # per field: [min(FREQUENT, cardinality)]
    factors: dict[int, np.ndarray]  # field -> [min(FREQUENT, cardinality), 4]

    @classmethod
    def of(cls, spec: CtrSpec) -> "PlantedLogit":
        rng = np.random.default_rng(spec.model_seed)
        sizes = [min(FREQUENT, c) for c in spec.cardinalities]
        weights = [rng.normal(0.0, 0.35, size=n) for n in sizes]
        factors = {f: rng.normal(0.0, 0.6, size=(sizes[f], 4)) for pair in INTERACTIONS for f in pair}
        return cls(bias=-2.1, dense=rng.normal(0.0, 0.08, size=len(DENSE)), weights=weights, factors=factors)

    def logit(self, dense: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """dense: [rows, 13] (-1 = missing); ranks: [rows, 26] (-1 = a fresh value)."""
        out = np.full(len(dense), self.bias) + np.log1p(np.maximum(dense, 0.0)) @ self.dense
        for f, w in enumerate(self.weights):
            known = (ranks[:, f] >= 0) & (ranks[:, f] < len(w))
            out[known] += w[ranks[known, f]]
        for a, b in INTERACTIONS:
            out += np.einsum("ij,ij->i", _factor(self.factors[a], ranks[:, a]), _factor(self.factors[b], ranks[:, b]))
        return out


def _factor(table: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """Each row's factor of its value (zero for a value without one)."""
    out = np.zeros((len(ranks), table.shape[1]))
    known = (ranks >= 0) & (ranks < len(table))
    out[known] = table[ranks[known]]
    return out


def _hex_values(field: int, ranks: np.ndarray, fresh: np.ndarray) -> np.ndarray:
    """The 8-hex-character value of each rank of a field (a fixed scramble of (field, rank)), and
    of each fresh draw (already a random 32-bit number)."""
    key = np.where(ranks >= 0, ranks.astype(np.uint64) * np.uint64(2654435761) + np.uint64(field * 97 + 1),
                   fresh.astype(np.uint64))
    key = (key ^ (key >> np.uint64(15))) * np.uint64(0x2C1B3C6D) & np.uint64(0xFFFFFFFF)
    nibbles = (key[:, None] >> np.arange(28, -1, -4, dtype=np.uint64)) & np.uint64(0xF)
    return np.ascontiguousarray(_HEX[nibbles.astype(np.intp)]).view("S8").reshape(-1)


_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


def _block_arrays(spec: CtrSpec, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dense [n, 13], ranks [n, 26] with -1 for fresh values, fresh [n, 26]) of one block. A whole
    block is drawn even when the log ends inside it, so a row is the same in a longer log."""
    n = min(BLOCK, spec.rows - block * BLOCK)
    rng = np.random.default_rng([spec.seed, block])
    missing = np.random.default_rng(spec.model_seed + 1).uniform(0.05, 0.40, size=len(DENSE))
    dense = np.floor(rng.lognormal(mean=1.0, sigma=1.2, size=(BLOCK, len(DENSE))))
    dense[rng.random((BLOCK, len(DENSE))) < missing] = MISSING_DENSE
    cards = np.array(spec.cardinalities)
    ranks = (rng.zipf(ZIPF_EXPONENT, size=(BLOCK, len(cards))) - 1) % cards
    fresh = rng.integers(0, 2**32, size=(BLOCK, len(cards)))
    ranks[rng.random((BLOCK, len(cards))) < spec.unseen] = -1
    return dense[:n], ranks[:n], fresh[:n]


def blocks(spec: CtrSpec, with_truth: bool = False) -> Iterator[pa.RecordBatch]:
    """The rows as Arrow record batches, block by block (with `true_probability` if asked)."""
    logit = PlantedLogit.of(spec)
    for block in range((spec.rows + BLOCK - 1) // BLOCK):
        dense, ranks, fresh = _block_arrays(spec, block)
        p = 1.0 / (1.0 + np.exp(-logit.logit(dense, ranks)))
        label = (np.random.default_rng([spec.seed, block, 1]).random(BLOCK)[:len(p)] < p).astype(np.int64)
        columns = {name: pa.array(dense[:, j].astype(np.float32)) for j, name in enumerate(DENSE)}
        for f, name in enumerate(CATEGORICAL):
            columns[name] = pa.array(_hex_values(f, ranks[:, f], fresh[:, f]), type=pa.binary()).cast(pa.string())
        columns[LABEL] = pa.array(label)
        if with_truth:
            columns[TRUE_PROBABILITY] = pa.array(p.astype(np.float32))
        yield pa.RecordBatch.from_pydict(columns)


def value_counts(spec: CtrSpec, column: str) -> Counter:
    """How many rows hold each value of a categorical column: the ground truth of per-row update
    counts (every row updates each of its values' embedding rows once per epoch)."""
    f = CATEGORICAL.index(column)
    counts: Counter = Counter()
    for block in range((spec.rows + BLOCK - 1) // BLOCK):
        _, ranks, fresh = _block_arrays(spec, block)
        counts.update(v.decode() for v in _hex_values(f, ranks[:, f], fresh[:, f]).tolist())
    return counts


def bayes_log_loss(probabilities: np.ndarray) -> float:
    """The expected log loss of the true probabilities themselves: no model can do better on
    average."""
    p = np.clip(probabilities.astype(np.float64), 1e-7, 1 - 1e-7)
    return float(-np.mean(p * np.log(p) + (1 - p) * np.log(1 - p)))


def parse_source(source: str) -> CtrSpec:
    """`synthetic:criteo?rows=N[&seed=S][&scale=F][&unseen=U]` as a spec; one-line errors."""
    name, _, query = source[len("synthetic:"):].partition("?")
    if name != "criteo":
        raise DataError(f"unknown source {source}: the synthetic source is synthetic:criteo?rows=N[&seed=S][&scale=F]")
    fields = {}
    for part in filter(None, query.split("&")):
        key, _, value = part.partition("=")
        kinds = {"rows": int, "seed": int, "scale": float, "unseen": float}
        if key not in kinds:
            raise DataError(f"{source}: unknown parameter {key!r}; known: {', '.join(kinds)}")
        try:
            fields[key] = kinds[key](value)
        except ValueError:
            raise DataError(f"{source}: {key}={value!r} is not a number") from None
    if "rows" not in fields:
        raise DataError(f"{source}: say how many rows, e.g. synthetic:criteo?rows=100000")
    try:
        return CtrSpec(**fields)
    except DataError as exc:
        raise DataError(f"{source}: {exc}") from None


def schema() -> pa.Schema:
    """The columns `blocks` yields (without the truth)."""
    return pa.schema([(n, pa.float32()) for n in DENSE] + [(n, pa.string()) for n in CATEGORICAL] + [(LABEL, pa.int64())])
