"""Fixtures for the component tests: each component runs through its `python_func` with real
KFP artifacts in a temporary folder and a real MLflow store (SQLite)."""

from __future__ import annotations

import pytest
from kfp.dsl import HTML, Dataset, Markdown, Metrics, Model


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory) -> str:
    from elastic_step.tracking.run import connect

    folder = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{folder}/mlflow.db"
    connect(uri, str(folder))  # the schema, once, before any step opens the file
    return uri


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> Dataset:
    from elastic_step.components import prepare_data

    folder = tmp_path_factory.mktemp("prepared")
    data = Dataset(uri=str(folder / "dataset"))
    summary = Markdown(uri=str(folder / "summary.md"))
    prepare_data.python_func(source="sklearn:digits", dataset=data, summary=summary, rows_per_shard=256)
    return data


@pytest.fixture(scope="session")
def trained(tmp_path_factory, dataset, mlflow_uri) -> Model:
    """One real elastic training job (2 local workers), shared by the evaluate/export/promote tests."""
    from elastic_step.components import train_elastic

    folder = tmp_path_factory.mktemp("trained")
    model = Model(uri=str(folder / "model"))
    metrics = Metrics(uri=str(folder / "metrics"))
    report = HTML(uri=str(folder / "report.html"))
    train_elastic.python_func(dataset=dataset, model=model, metrics=metrics, report=report, workers="2", epochs=4,
                              minibatch_size=16, checkpoint_steps=0, mlflow_uri=mlflow_uri, job_dir=str(folder / "job"))
    model.test_metrics = dict(metrics.metadata)
    model.report_path = report.path
    return model
