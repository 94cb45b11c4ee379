"""The gate judges a click model (one logit per row, 0/1 labels) on AUC and log loss, the
figures a CTR team promotes on, not as a regression of its logits: what the metrics are, that
they land on the evaluation run, and that a floor and a gain on them bless or refuse."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import log_loss, roc_auc_score

from elastic_step.errors import ConfigError
from elastic_step.release.gate import _evaluate, as_predictions, model_type_of
from elastic_step.release.thresholds import build_thresholds, to_mlflow


def clicks(n: int = 4000, signal: float = 2.0, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Logits [n, 1] and labels drawn from them: `signal` scales how much the logits know."""
    rng = np.random.default_rng(seed)
    truth = rng.normal(size=n)
    labels = (rng.random(n) < 1 / (1 + np.exp(-2 * truth))).astype(np.int64)
    return (signal * truth + rng.normal(size=n) * (3 - signal)).reshape(-1, 1).astype(np.float32), labels


def test_a_logit_per_row_against_0_1_labels_is_a_binary_model():
    logits, labels = clicks(100)
    assert model_type_of(logits, labels) == "binary"
    assert model_type_of(logits[:, 0], labels.astype(np.float32)) == "binary"  # float labels, a flat output
    assert model_type_of(np.zeros((100, 10)), np.arange(100) % 10) == "classifier"
    assert model_type_of(logits, np.linspace(0, 5, 100)) == "regressor"


def test_auc_log_loss_and_accuracy_are_those_of_the_click_probabilities_and_land_on_the_run(tmp_path):
    import mlflow

    logits, labels = clicks()
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    with mlflow.start_run() as run:
        result = _evaluate(as_predictions(logits, "binary"), labels, "binary", [0, 1])
    p = 1 / (1 + np.exp(-logits[:, 0].astype(np.float64)))
    assert result.metrics["auc"] == pytest.approx(roc_auc_score(labels, p), abs=1e-12)
    assert result.metrics["log_loss"] == pytest.approx(log_loss(labels, p), abs=1e-9)
    assert result.metrics["accuracy_score"] == pytest.approx(((p >= 0.5) == labels).mean())
    logged = mlflow.tracking.MlflowClient().get_run(run.info.run_id).data.metrics
    assert logged == pytest.approx(result.metrics)


def test_a_floor_on_auc_and_a_gain_in_log_loss_bless_the_better_model_only(tmp_path):
    import mlflow
    from mlflow.exceptions import MlflowException

    thresholds = build_thresholds({"roc_auc": 0.6}, {"log_loss": 0.0}, "binary")  # the alias, and lower-is-better
    assert {(t.metric, t.greater_is_better) for t in thresholds} == {("auc", True), ("log_loss", False)}
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    with mlflow.start_run():
        weak_logits, labels = clicks(signal=0.3)
        strong_logits, _ = clicks(signal=2.5)
        weak = _evaluate(as_predictions(weak_logits, "binary"), labels, "binary", [0, 1])
        strong = _evaluate(as_predictions(strong_logits, "binary"), labels, "binary", [0, 1])
    assert strong.metrics["auc"] > 0.6 > weak.metrics["auc"] > 0.5
    mlflow.validate_evaluation_results(to_mlflow(thresholds, True), strong, weak)  # blessed over the weak champion
    with pytest.raises(MlflowException):
        mlflow.validate_evaluation_results(to_mlflow(thresholds, True), weak, strong)
    with pytest.raises(ConfigError, match="unknown metric 'r2' for a binary"):
        build_thresholds({"r2": 0.5}, {}, "binary")
