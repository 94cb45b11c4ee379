import pytest
from kfp.dsl import ClassificationMetrics, Markdown, Metrics
from mlflow.tracking import MlflowClient

from elastic_step.components import evaluate_model
from elastic_step.errors import ConfigError

MODEL_DEF = "elastic_step.model_zoo.digits_torch"


def run_gate(tmp_path, trained, dataset, mlflow_uri, **thresholds):
    outputs = dict(metrics=Metrics(uri=str(tmp_path / "m")), classification=ClassificationMetrics(uri=str(tmp_path / "c")),
                   report=Markdown(uri=str(tmp_path / "report.md")))
    result = evaluate_model.python_func(candidate=trained, dataset=dataset, registered_model="gate-test",
                                        model_def=MODEL_DEF, mlflow_uri=mlflow_uri, **outputs, **thresholds)
    return result, outputs


def test_first_model_is_judged_on_the_floors_alone(tmp_path, trained, dataset, mlflow_uri):
    result, out = run_gate(tmp_path, trained, dataset, mlflow_uri, floors={"accuracy": 0.5}, min_gains={"accuracy": 0.0})
    assert result.blessed is True
    assert "first model" in result.reason and "accuracy_score" in result.reason
    assert abs(out["metrics"].metadata["accuracy_score"] - trained.test_metrics["accuracy"]) < 1e-9
    matrix = out["classification"].metadata["confusionMatrix"]
    assert len(matrix["rows"]) == 10 and sum(sum(r["row"]) for r in matrix["rows"]) == 180
    report = open(out["report"].path).read()
    assert "Blessed" in report and "| accuracy_score |" in report
    tags = MlflowClient(mlflow_uri).get_run(trained.metadata["mlflow_run_id"]).data.tags
    assert tags["elastic_step.gate.blessed"] == "true" and "accuracy_score" in tags["elastic_step.gate.reason"]


def test_a_floor_the_candidate_misses_is_the_reason(tmp_path, trained, dataset, mlflow_uri):
    result, out = run_gate(tmp_path, trained, dataset, mlflow_uri, floors={"accuracy": 0.999})
    assert result.blessed is False
    assert "misses the floor 0.999" in result.reason and "Not blessed" in open(out["report"].path).read()


def test_a_threshold_on_an_unknown_metric_fails_before_anything_is_logged(tmp_path, trained, dataset, mlflow_uri):
    with pytest.raises(ConfigError, match="unknown metric 'acuracy'.*accuracy"):
        run_gate(tmp_path, trained, dataset, mlflow_uri, floors={"acuracy": 0.9})


def test_a_test_split_that_ends_up_empty_is_a_clear_error(tmp_path, trained, mlflow_uri):
    from kfp.dsl import Dataset

    from elastic_step.components import prepare_data
    from elastic_step.errors import DataError

    no_test = Dataset(uri=str(tmp_path / "no-test"))
    prepare_data.python_func(source="sklearn:digits", dataset=no_test, summary=Markdown(uri=str(tmp_path / "s.md")),
                             split="0.9,0.1,0")
    with pytest.raises(DataError, match="test split .* is empty"):
        run_gate(tmp_path, trained, no_test, mlflow_uri, floors={"accuracy": 0.5})


def test_the_gate_and_export_never_read_a_whole_split_at_once(tmp_path, trained, dataset, mlflow_uri, monkeypatch):
    """A test split larger than memory must still be judged: the gate predicts shard by shard and
    export reads the few rows of its input example, never `read_split`."""
    from elastic_step.components import export_model
    from elastic_step.data import reader

    def whole_split(*args, **kwargs):
        raise AssertionError("read a whole split into memory")

    monkeypatch.setattr(reader.ShardReader, "read_split", whole_split)
    reads = []
    original = reader.ShardReader.read
    monkeypatch.setattr(reader.ShardReader, "read", lambda self, *a, **k: reads.append(a) or original(self, *a, **k))
    result, out = run_gate(tmp_path, trained, dataset, mlflow_uri, floors={"accuracy": 0.5})
    assert result.blessed is True
    assert abs(out["metrics"].metadata["accuracy_score"] - trained.test_metrics["accuracy"]) < 1e-9
    assert sum(count for split, _, _, count in reads if split == "test") == 180  # every test row, once
    reads.clear()
    export_model.python_func(candidate=trained, dataset=dataset, registered_model="reads-test", model_def=MODEL_DEF,
                             mlflow_uri=mlflow_uri)
    assert reads == [("test", 0, 0, 5)]
