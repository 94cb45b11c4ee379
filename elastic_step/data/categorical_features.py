"""A model definition's sparse features: columns of a batch into ids, through the manifest's specs.

A model definition declares them once, at module level, and uses the same object in `model()`
(to size its embedding table) and in `feed()` (to turn a batch into ids), whatever its framework:

    from elastic_step.data.categorical_features import SparseFeatures

    SPARSE = SparseFeatures("site", "device", "age")

    def model():
        return Net(num_ids=SPARSE.num_ids, fields=len(SPARSE.columns))   # one table, every field

    def feed(batch):
        return {"ids": SPARSE.ids(batch), ...}, batch["label"]

The specs (hash bins, vocabulary, bucket boundaries) are the dataset's, recorded by prepare-data.
The engine's feed passes a batch only, so a `SparseFeatures` binds to the dataset this process
loaded last (every process of a job — master, worker, evaluation — loads exactly one), the way
ElasticDL's model definitions found the analysis results in their environment; `bind(manifest)`
names one explicitly. So ask for sizes and ids inside `model()` and `feed()`, not at import:
a worker imports the model definition before it loads the manifest. The ids are numpy int64 arrays: the same for a PyTorch and a Keras model.
"""

from __future__ import annotations

import threading

import numpy as np

from elastic_step.data.categorical import ConcatWithOffset
from elastic_step.errors import DataError

_current = {"manifest": None}
_lock = threading.Lock()


def remember_dataset(manifest) -> None:
    """The dataset whose specs unbound sparse features use (called by `load_manifest`)."""
    with _lock:
        _current["manifest"] = manifest


class SparseFeatures:
    """The columns a model embeds, each through its spec, side by side in one table of `num_ids`
    rows (ConcatWithOffset), or field by field (`field_ids`, `sizes`) for a table per field."""

    def __init__(self, *columns: str):
        if not columns or not all(isinstance(c, str) and c for c in columns) or len(set(columns)) != len(columns):
            raise ValueError(f"SparseFeatures takes distinct column names, got {columns!r}")
        self.columns = list(columns)
        self._manifest = None  # bound explicitly; else the dataset loaded last
        self._built_for = None
        self._layers: list = []
        self._concat: ConcatWithOffset | None = None

    def bind(self, manifest) -> "SparseFeatures":
        """Use `manifest`'s specs rather than those of the dataset this process loaded last."""
        self._manifest = manifest
        return self

    def _built(self):
        manifest = self._manifest if self._manifest is not None else _current["manifest"]
        if manifest is None:
            raise DataError(f"sparse features {', '.join(self.columns)} have no dataset: load its manifest "
                            "(load_manifest) or call SparseFeatures.bind(manifest) first")
        if manifest is not self._built_for:
            missing = [c for c in self.columns if c not in manifest.categorical]
            if missing:
                raise DataError(f"the model definition's sparse feature {missing[0]!r} has no vocabulary, hash or "
                                f"buckets in the manifest at {manifest.root or manifest.source} — re-run prepare-data "
                                f"with --categorical {missing[0]}=... (or --buckets for a number)")
            specs = [manifest.categorical[c] for c in self.columns]
            self._layers = [spec.layer() for spec in specs]
            self._concat = ConcatWithOffset([layer.num_ids for layer in self._layers], names=self.columns)
            self._built_for = manifest
        return self._layers, self._concat

    @property
    def sizes(self) -> list[int]:
        """Ids per column, in declaration order."""
        return list(self._built()[1].sizes)

    @property
    def num_ids(self) -> int:
        """Rows of one table holding every column's ids."""
        return self._built()[1].num_ids

    def field_ids(self, batch: dict) -> dict[str, np.ndarray]:
        """column -> int64 ids in [0, its size)."""
        layers, _ = self._built()
        absent = [c for c in self.columns if c not in batch]
        if absent:
            raise DataError(f"the batch lacks sparse feature column {absent[0]!r} (it has {', '.join(batch)})")
        return {column: layer(batch[column]) for column, layer in zip(self.columns, layers)}

    def ids(self, batch: dict) -> np.ndarray:
        """[rows, columns] int64 ids into one table of `num_ids` rows."""
        fields = self.field_ids(batch)
        return self._built()[1]([fields[c] for c in self.columns])
