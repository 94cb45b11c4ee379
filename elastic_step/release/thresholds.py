"""Evaluation thresholds as users write them (`accuracy=0.9`) and as MLflow checks them."""

from __future__ import annotations

from dataclasses import dataclass

from elastic_step.errors import ConfigError

# What mlflow.models.evaluate's default evaluator reports from class predictions or values.
CLASSIFIER_METRICS = {"accuracy_score": True, "precision_score": True, "recall_score": True, "f1_score": True}
# A binary model's (one logit per row): computed by the gate itself (release/gate.py).
BINARY_METRICS = {"auc": True, "log_loss": False, "accuracy_score": True}
REGRESSOR_METRICS = {"mean_squared_error": False, "root_mean_squared_error": False, "mean_absolute_error": False,
                     "r2_score": True, "max_error": False, "mean_absolute_percentage_error": False}
ALIASES = {"accuracy": "accuracy_score", "precision": "precision_score", "recall": "recall_score", "f1": "f1_score",
           "mse": "mean_squared_error", "rmse": "root_mean_squared_error", "mae": "mean_absolute_error", "r2": "r2_score",
           "roc_auc": "auc", "logloss": "log_loss"}


STRICTLY_BETTER = 1e-9


@dataclass
class Threshold:
    metric: str
    floor: float | None  # the candidate must reach this, champion or not
    min_gain: float | None  # ... and beat the champion by at least this much, when there is one
    greater_is_better: bool


def parse_pairs(values, what: str) -> dict[str, float]:
    """`["accuracy=0.9", ...]`, `"accuracy=0.9,f1=0.8"` or a dict → {name: value}."""
    if not values:
        return {}
    if isinstance(values, dict):
        items = list(values.items())
    else:
        texts = [values] if isinstance(values, str) else list(values)
        items = []
        for text in texts:
            for pair in filter(None, (p.strip() for p in text.split(","))):
                name, sep, value = pair.partition("=")
                if not sep:
                    raise ConfigError(f"{what} {pair!r} is not METRIC=VALUE (e.g. accuracy=0.9)")
                items.append((name.strip(), value))
    parsed = {}
    for name, value in items:
        try:
            parsed[str(name)] = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{what} {name}={value!r}: the value is not a number") from None
    return parsed


def build_thresholds(floors: dict, min_gains: dict, model_type: str) -> list[Threshold]:
    known = {"classifier": CLASSIFIER_METRICS, "binary": BINARY_METRICS}.get(model_type, REGRESSOR_METRICS)
    merged: dict[str, Threshold] = {}
    for kind, values in (("floor", floors), ("min_gain", min_gains)):
        for name, value in values.items():
            metric = ALIASES.get(name, name)
            if metric not in known:
                raise ConfigError(
                    f"threshold names an unknown metric {name!r} for a {model_type}; "
                    f"use one of: {', '.join(sorted(set(known) | {a for a, m in ALIASES.items() if m in known}))}"
                )
            if kind == "min_gain" and value < 0:
                raise ConfigError(f"minimum gain {name}={value} is negative; use 0 (or more) so a candidate must beat the champion")
            entry = merged.setdefault(metric, Threshold(metric, None, None, known[metric]))
            setattr(entry, kind, value)
    if not merged:
        raise ConfigError("no thresholds: give at least one floor (e.g. accuracy=0.9) so the gate can judge a model")
    return list(merged.values())


def to_mlflow(thresholds: list[Threshold], with_baseline: bool) -> dict:
    """MLflow's MetricThreshold per metric; the gain part only when there is a champion to beat
    (the first model ever is judged on the floors alone)."""
    from mlflow.models import MetricThreshold

    checks = {}
    for t in thresholds:
        gain = t.min_gain if with_baseline else None
        if gain is not None:
            # MLflow takes only a positive change; a gain of 0 means "strictly better than the
            # champion" (a retrained model that merely ties it is not promoted).
            gain = max(gain, STRICTLY_BETTER)
        if t.floor is None and gain is None:
            continue
        checks[t.metric] = MetricThreshold(threshold=t.floor, min_absolute_change=gain, greater_is_better=t.greater_is_better)
    return checks
