from typing import NamedTuple

from kfp import dsl
from kfp.dsl import ClassificationMetrics, Dataset, Input, Markdown, Metrics, Model, Output

from elastic_step.images import default_image


@dsl.component(base_image=default_image(), install_kfp_package=False)
def evaluate_model(
    candidate: Input[Model],
    dataset: Input[Dataset],
    registered_model: str,
    model_def: str,
    metrics: Output[Metrics],
    classification: Output[ClassificationMetrics],
    report: Output[Markdown],
    floors: dict = {"accuracy": 0.9},
    min_gains: dict = {"accuracy": 0.0},
    mlflow_uri: str = "",
) -> NamedTuple("GateOutputs", [("blessed", bool), ("reason", str)]):
    """Judge the candidate and the current @champion on the same test rows; bless the candidate
    only when it clears every floor and beats the champion by the required gain.

    Both models are evaluated with `mlflow.models.evaluate` and gated with
    `mlflow.validate_evaluation_results`; the first model ever is judged on the floors alone.

    Args:
        candidate: The trained model from train_elastic.
        dataset: The prepared data; its test split is used.
        registered_model: The registered model whose @champion the candidate must beat.
        model_def: The model definition the candidate was trained with (the pipeline's model_def), whose network the weights are loaded into; the training run's own model_def parameter is never used.
        metrics: The candidate's metrics.
        classification: The candidate's confusion matrix (classifiers).
        report: Every metric, its threshold and the champion's value, as Markdown.
        floors: Metric → the value the candidate must reach (e.g. {"accuracy": 0.9}).
        min_gains: Metric → how much the candidate must beat the champion by (0: strictly better).
        mlflow_uri: Tracking URI (default: MLFLOW_TRACKING_URI).

    Returns:
        blessed: Whether the candidate may be exported and promoted.
        reason: Why, in one line.
    """
    from collections import namedtuple

    from elastic_step.release.gate import evaluate_candidate

    result = evaluate_candidate(
        run_id=candidate.metadata["mlflow_run_id"], model_uri=candidate.metadata.get("model_uri", ""), data=dataset.path,
        registered_model=registered_model, floors=floors, min_gains=min_gains, mlflow_uri=mlflow_uri or None,
        model_def=model_def,
    )
    for name, value in result.candidate_metrics.items():
        metrics.log_metric(name, value)
    if result.confusion_matrix:
        classification.log_confusion_matrix(result.categories, result.confusion_matrix)
    with open(report.path, "w") as f:
        f.write(result.report)
    return namedtuple("GateOutputs", ["blessed", "reason"])(result.blessed, result.reason)
