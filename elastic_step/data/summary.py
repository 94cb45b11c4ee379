"""A short Markdown description of prepared data: what a person checks before training on it."""

from __future__ import annotations

import numpy as np

from elastic_step.data.manifest import Manifest
from elastic_step.data.reader import ShardReader

MAX_CLASSES_LISTED = 30


def summary_markdown(manifest: Manifest) -> str:
    lines = [f"# Dataset `{manifest.source}`", "",
             f"Content hash `{manifest.content_hash[:16]}`; label `{manifest.label}`; {len(manifest.features)} features.", "",
             "| split | rows | shards |", "|---|---|---|"]
    for name, shards in manifest.splits.items():
        lines.append(f"| {name} | {sum(s.rows for s in shards)} | {len(shards)} |")
    lines += ["", "| column | type |", "|---|---|"]
    lines += [f"| {column} | {manifest.schema.get(column, '?')} |" for column in [manifest.label, *manifest.features]]
    if manifest.categorical:
        lines += ["", "Categorical features (ids from the training split):", "", "| column | encoding | ids | how |",
                  "|---|---|---|---|"]
        lines += [f"| {c} | {spec.encoding.value} | {spec.num_ids} | {spec.how()}{' (inferred)' if spec.inferred else ''} |"
                  for c, spec in manifest.categorical.items()]
    balance = class_balance(manifest)
    if balance:
        lines += ["", "Class balance (train):", "", "| class | rows | share |", "|---|---|---|"]
        total = sum(balance.values())
        lines += [f"| {label} | {count} | {count / total:.1%} |" for label, count in list(balance.items())[:MAX_CLASSES_LISTED]]
    return "\n".join(lines) + "\n"


def class_balance(manifest: Manifest) -> dict:
    """Rows per label value in the train split, for integer or string labels (not regression)."""
    if manifest.rows("train") == 0 or manifest.schema.get(manifest.label, "").startswith(("float", "double")):
        return {}
    labels = ShardReader(manifest).read_split("train", columns=[manifest.label])[manifest.label]
    values, counts = np.unique(labels, return_counts=True)
    return {str(v): int(c) for v, c in zip(values.tolist(), counts.tolist())}
