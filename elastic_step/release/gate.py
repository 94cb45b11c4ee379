"""The evaluation gate: judge a candidate and the current @champion on the same rows with
`mlflow.models.evaluate`, and bless the candidate only when `mlflow.validate_evaluation_results`
says it clears every floor and beats the champion by the required gain. The first model ever is
judged on the floors alone. The reason — every metric, its threshold and the champion's value —
goes into the report and onto the MLflow runs."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field

import numpy as np

from elastic_step.errors import ConfigError
from elastic_step.frameworks.model_def import load_model_definition
from elastic_step.release.candidate import Candidate, load_candidate, predict_split
from elastic_step.release.registry import CHAMPION, registry_client, version_by_alias
from elastic_step.release.thresholds import Threshold, build_thresholds, parse_pairs, to_mlflow
from elastic_step.tracking.handover import take_task_run
from elastic_step.tracking.run import RunOutcome, run_outcome
from elastic_step.tracking.uri import use_tracking_uri

log = logging.getLogger("elastic_step.release")

GATE_TAG = "elastic_step.gate"


@dataclass
class GateResult:
    blessed: bool
    reason: str
    candidate_metrics: dict
    champion_metrics: dict | None
    champion_version: str | None
    model_type: str
    evaluation_run_id: str
    report: str  # Markdown
    categories: list = field(default_factory=list)
    confusion_matrix: list = field(default_factory=list)  # rows: true class, columns: predicted


def model_type_of(outputs: np.ndarray, labels: np.ndarray) -> str:
    """classifier: one output per class; binary: one logit per row against 0/1 labels (a click
    model, trained with binary cross-entropy on logits); regressor: anything else."""
    if outputs.ndim == 2 and outputs.shape[1] > 1 and np.issubdtype(labels.dtype, np.integer):
        return "classifier"
    if outputs.reshape(len(outputs), -1).shape[1] == 1 and len(labels) and np.isin(labels, (0, 1)).all():
        return "binary"
    return "regressor"


def as_predictions(outputs: np.ndarray, model_type: str) -> np.ndarray:
    """A class per row (classifier), else the one output per row (a binary model's logit)."""
    return outputs.argmax(axis=1) if model_type == "classifier" else outputs.reshape(len(outputs), -1)[:, 0]


def _evaluate_binary(logits: np.ndarray, labels: np.ndarray):
    """AUC, log loss and accuracy of a binary model's logits. MLflow's evaluator computes AUC and
    log loss only from a model it can ask for probabilities; here there are outputs alone."""
    import mlflow
    from mlflow.models import EvaluationResult
    from sklearn.metrics import log_loss, roc_auc_score

    clicks = labels.astype(np.int64)
    probability = 1.0 / (1.0 + np.exp(-np.clip(logits.astype(np.float64), -50.0, 50.0)))
    metrics = {"accuracy_score": float(((probability >= 0.5) == clicks).mean()),
               "log_loss": float(log_loss(clicks, probability, labels=[0, 1]))}
    if len(np.unique(clicks)) == 2:  # undefined on one class (the gate then names the split)
        metrics["auc"] = float(roc_auc_score(clicks, probability))
    mlflow.log_metrics(metrics)  # on the evaluation run, as mlflow.models.evaluate logs its own
    return EvaluationResult(metrics=metrics, artifacts={})


def _evaluate(predictions: np.ndarray, labels: np.ndarray, model_type: str, label_list):
    import mlflow
    import pandas as pd

    if model_type == "binary":
        return _evaluate_binary(predictions, labels)
    config = {"log_model_explainability": False}
    if model_type == "classifier":
        config["label_list"] = label_list
    # The default evaluator guesses the model type from the labels and warns when its guess
    # differs from the one given, and schema inference warns about integer labels: both are
    # noise here, where the type is known and there are no missing values.
    quiet = logging.getLogger("mlflow.models.evaluation")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Ii]nteger column", category=UserWarning)
            return mlflow.models.evaluate(
                data=pd.DataFrame({"label": labels, "prediction": predictions}), targets="label", predictions="prediction",
                model_type=model_type, evaluator_config=config,
            )
    finally:
        quiet.setLevel(level)


def evaluate_candidate(*, run_id: str, model_uri: str, data: str, registered_model: str, floors=None, min_gains=None,
                       mlflow_uri: str | None = None, model_def: str | None = None) -> GateResult:
    """`model_def`: the pipeline's model definition (both the candidate's and the champion's
    weights are loaded into its network; nothing is unpickled)."""
    import mlflow

    client = registry_client(mlflow_uri)
    candidate = load_candidate(client, run_id, model_uri, model_def)
    require_succeeded(client, run_id)
    floors, min_gains = parse_pairs(floors, "floor"), parse_pairs(min_gains, "minimum gain")
    champion = version_by_alias(client, registered_model, CHAMPION)
    judged, thresholds = _predictions_and_thresholds(client, candidate, registered_model, champion, data, floors, min_gains)

    use_tracking_uri(client.tracking_uri)
    # Under KFP's MLflow integration the evaluation is a child of this task's run (MLflow's
    # start_run would otherwise reopen that run and re-parent it); elsewhere, of the candidate's.
    task = take_task_run(client.tracking_uri)
    with mlflow.start_run(experiment_id=candidate.experiment_id, run_name=f"evaluate {registered_model}",
                          tags={"mlflow.parentRunId": task.run_id if task else run_id, GATE_TAG: "evaluation",
                                f"{GATE_TAG}.candidate_run_id": run_id}) as run:
        result = _judge(judged, thresholds, champion, candidate.experiment_id, run.info.run_id)
        result.report = report_markdown(result, candidate, registered_model, thresholds)
        mlflow.log_text(result.report, "gate/report.md")
        mlflow.set_tags({f"{GATE_TAG}.blessed": str(result.blessed).lower(), f"{GATE_TAG}.reason": result.reason[:4000]})
    # The candidate's own training run says how it was judged, too.
    client.set_tag(run_id, f"{GATE_TAG}.blessed", str(result.blessed).lower())
    client.set_tag(run_id, f"{GATE_TAG}.reason", result.reason[:4000])
    log.info(result.reason)
    return result


@dataclass
class _Judged:
    """The test split's labels and both models' predictions on it, as the evaluator takes them."""

    labels: np.ndarray
    model_type: str
    label_list: list | None  # a classifier's or binary model's classes (None: a regressor)
    predictions: np.ndarray
    champion_predictions: np.ndarray | None


def _predictions_and_thresholds(client, candidate: Candidate, registered_model: str, champion, data: str, floors,
                                min_gains) -> tuple[_Judged, list[Threshold]]:
    """Both models' outputs on the test split, the model type they show, and the thresholds for
    that type."""
    uris = [candidate.model_uri] + ([f"models:/{registered_model}@{CHAMPION}"] if champion is not None else [])
    outputs, labels = predict_split(uris, data, load_model_definition(candidate.model_def_source), tracking_uri=client.tracking_uri)
    outputs, champion_outputs = outputs[0], (outputs[1] if champion is not None else None)
    model_type = model_type_of(outputs, labels)
    thresholds = build_thresholds(floors, min_gains, model_type)  # unknown metric: fail before logging anything
    if model_type == "binary" and any(t.metric == "auc" for t in thresholds) and len(np.unique(labels)) < 2:
        raise ConfigError(f"the test split of {data} holds only label {int(labels[0])}: AUC is undefined there; "
                          "prepare the data with both labels in the test split, or judge on log_loss")
    label_list = {"classifier": sorted(set(labels.tolist()) | set(range(outputs.reshape(len(outputs), -1).shape[1]))),
                  "binary": [0, 1]}.get(model_type)
    predictions = as_predictions(outputs, model_type)
    champion_predictions = None if champion is None else as_predictions(champion_outputs, model_type)
    return _Judged(labels, model_type, label_list, predictions, champion_predictions), thresholds


def _judge(judged: _Judged, thresholds: list[Threshold], champion, experiment_id: str, evaluation_run_id: str) -> GateResult:
    """Both models evaluated in the active (evaluation) run, the champion in a nested one, and the
    candidate blessed when MLflow's validation passes: the result, its report still to write."""
    import mlflow
    from mlflow.exceptions import MlflowException

    candidate_result = _evaluate(judged.predictions, judged.labels, judged.model_type, judged.label_list)
    champion_result = None
    if champion is not None:
        # A nested run goes to MLflow's active experiment (Default, "0"), not its parent's, unless told.
        with mlflow.start_run(experiment_id=experiment_id, run_name=f"champion v{champion.version}", nested=True):
            champion_result = _evaluate(judged.champion_predictions, judged.labels, judged.model_type, judged.label_list)
    failure = ""
    try:
        mlflow.validate_evaluation_results(to_mlflow(thresholds, champion is not None), candidate_result, champion_result)
    except MlflowException as exc:  # ModelValidationFailedException: the candidate did not pass
        failure = str(exc)
    blessed = not failure
    reason = explain(thresholds, candidate_result.metrics, champion_result.metrics if champion_result else None,
                     str(champion.version) if champion else None, blessed)
    result = GateResult(
        blessed=blessed, reason=reason, candidate_metrics=_plain(candidate_result.metrics),
        champion_metrics=_plain(champion_result.metrics) if champion_result else None,
        champion_version=str(champion.version) if champion else None, model_type=judged.model_type,
        evaluation_run_id=evaluation_run_id, report="",
    )
    if judged.label_list is not None:
        _add_confusion_matrix(result, judged)
    return result


def _add_confusion_matrix(result: GateResult, judged: _Judged) -> None:
    """The candidate's confusion matrix, for a model with classes (a binary model's at p = 0.5)."""
    from sklearn.metrics import confusion_matrix

    binary = judged.model_type == "binary"
    decided = (judged.predictions >= 0).astype(np.int64) if binary else judged.predictions  # logit 0: p = 0.5
    result.categories = [str(c) for c in judged.label_list]
    result.confusion_matrix = confusion_matrix(judged.labels.astype(np.int64) if binary else judged.labels,
                                               decided, labels=judged.label_list).tolist()


def require_succeeded(client, run_id: str) -> None:
    """Only a training run that finished is judged: a preempted, stopped or failed one has no final
    model of its own (any model its run holds is an earlier attempt's), and a running one is not
    done. Refused in one line, as bad input: evaluating it again cannot help."""
    outcome = run_outcome(client.get_run(run_id))
    if outcome != RunOutcome.SUCCEEDED:
        raise ConfigError(f"training run {run_id} is {outcome}, not succeeded, so it has no final model to judge; "
                          "run the train step again (it resumes that run) and evaluate the run it then reports")


def _plain(metrics: dict) -> dict:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float, np.floating, np.integer))}


def explain(thresholds: list[Threshold], candidate: dict, champion: dict | None, champion_version: str | None,
            blessed: bool) -> str:
    """One line a person can act on: each metric, its floor, the champion's value and the gain."""
    parts = []
    for t in thresholds:
        value = candidate[t.metric]
        words = [f"{t.metric} {value:.4f}"]
        if t.floor is not None:
            ok = value >= t.floor if t.greater_is_better else value <= t.floor
            words.append(f"{'meets' if ok else 'misses'} the floor {t.floor:g}")
        if t.min_gain is not None:
            if champion is None:
                words.append("no champion to beat yet")
            else:
                gain = (value - champion[t.metric]) if t.greater_is_better else (champion[t.metric] - value)
                ok = gain > 0 and gain >= t.min_gain
                words.append(f"champion v{champion_version} {champion[t.metric]:.4f}, gain {gain:+.4f} "
                             f"{'meets' if ok else 'misses'} the required {t.min_gain:g} (strictly better)")
        parts.append(", ".join(words))
    verdict = "blessed" if blessed else "not blessed"
    against = f" against champion v{champion_version}" if champion_version else " (first model: floors only)"
    return f"{verdict}{against}: " + "; ".join(parts)


def report_markdown(result: GateResult, candidate: Candidate, registered_model: str, thresholds: list[Threshold]) -> str:
    lines = [
        f"# Evaluation of the candidate for `{registered_model}`", "",
        f"**{'Blessed' if result.blessed else 'Not blessed'}.** {result.reason}", "",
        f"Candidate: training run `{candidate.run_id}`, model `{candidate.model_uri}`.  ",
        f"Champion: {'version ' + result.champion_version if result.champion_version else 'none yet'}.", "",
        "| metric | candidate | floor | champion | required gain |", "|---|---|---|---|---|",
    ]
    by_metric = {t.metric: t for t in thresholds}
    for name in sorted(result.candidate_metrics):
        t = by_metric.get(name)
        champion = result.champion_metrics.get(name) if result.champion_metrics else None
        lines.append(f"| {name} | {result.candidate_metrics[name]:.4f} | {'' if not t or t.floor is None else f'{t.floor:g}'} | "
                     f"{'' if champion is None else f'{champion:.4f}'} | {'' if not t or t.min_gain is None else f'{t.min_gain:g}'} |")
    return "\n".join(lines) + "\n"
