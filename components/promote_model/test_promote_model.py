import pytest
from mlflow.tracking import MlflowClient

from elastic_step.components import promote_model
from elastic_step.release.export import export_model
from elastic_step.release.promote import rollback
from elastic_step.tracking.run import TrackingError


def aliases(mlflow_uri, name):
    client = MlflowClient(mlflow_uri)
    return {a: str(client.get_model_version_by_alias(name, a).version) for a in ("champion", "previous-champion")
            if a in client.get_registered_model(name).aliases}


def test_promote_moves_champion_keeps_the_previous_one_and_rolls_back(trained, dataset, mlflow_uri):
    import mlflow

    name = "promote-test"
    v1 = export_model(run_id=trained.metadata["mlflow_run_id"], model_uri="", data=dataset.path, registered_model=name,
                      mlflow_uri=mlflow_uri).version
    # a second version of the same model (registered straight from the logged model)
    mlflow.set_tracking_uri(mlflow_uri)
    v2 = str(mlflow.register_model(trained.metadata["model_uri"], name).version)

    first = promote_model.python_func(registered_model=name, version=v1, mlflow_uri=mlflow_uri)
    assert (first.champion_version, first.previous_champion_version) == (v1, "")
    second = promote_model.python_func(registered_model=name, version=v2, mlflow_uri=mlflow_uri)
    assert (second.champion_version, second.previous_champion_version) == (v2, v1)
    # idempotent: a retried promote changes nothing, and the previous champion is not lost
    promote_model.python_func(registered_model=name, version=v2, mlflow_uri=mlflow_uri)
    assert aliases(mlflow_uri, name) == {"champion": v2, "previous-champion": v1}
    back = rollback(name, mlflow_uri=mlflow_uri)
    assert back.champion == v1 and aliases(mlflow_uri, name) == {"champion": v1, "previous-champion": v2}


def test_promoting_a_version_that_does_not_exist_changes_nothing(trained, mlflow_uri):
    with pytest.raises(TrackingError, match="no version '99'"):
        promote_model.python_func(registered_model="promote-test", version="99", mlflow_uri=mlflow_uri)
