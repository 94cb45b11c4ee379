"""The deploy_model component: a thin shell over elastic_step.release.deploy (tested with the
cluster stand-in in tests/test_deploy_*.py); here, its inputs reach the engine and bad input
fails the step before any cluster is contacted."""


import numpy as np
import pytest

from elastic_step.components import deploy_model
from elastic_step.errors import ConfigError
from elastic_step.tracking.run import TrackingError

NAME = "deploy-component-test"


@pytest.fixture(scope="module")
def version(mlflow_uri, tmp_path_factory):
    import mlflow
    import mlflow.pytorch
    import torch
    from mlflow.models import infer_signature

    from elastic_step.tracking.uri import use_tracking_uri

    use_tracking_uri(mlflow_uri)
    folder = tmp_path_factory.mktemp("artifacts")
    experiment = mlflow.create_experiment("deploy-component", artifact_location=str(folder))
    net = torch.nn.Linear(4, 2).eval()
    example = np.ones((2, 4), dtype=np.float32)
    with mlflow.start_run(experiment_id=experiment):
        info = mlflow.pytorch.log_model(torch.jit.trace(net, torch.from_numpy(example)), name="serving-model",
                                        signature=infer_signature(example, net(torch.from_numpy(example)).detach().numpy()),
                                        serialization_format="pickle")
    return str(mlflow.register_model(info.model_uri, NAME).version)


def call(mlflow_uri, **kwargs):
    return deploy_model.python_func(registered_model=NAME, namespace="serving", service_account="model-server",
                                    storage_secret="model-store", mlflow_uri=mlflow_uri, **kwargs)


def test_an_unknown_version_fails_the_step_as_bad_input(version, mlflow_uri):
    with pytest.raises(TrackingError, match=f"registered model '{NAME}' has no version '99' \\(it has {version}\\)"):
        call(mlflow_uri, version="99")


def test_alias_and_version_together_are_refused(version, mlflow_uri):
    with pytest.raises(ConfigError, match="give exactly one of --alias"):
        call(mlflow_uri, version=version, alias="champion")


def test_a_step_that_finds_no_cluster_says_so_before_writing(version, mlflow_uri, tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    monkeypatch.setenv("ELASTIC_STEP_SERVICEACCOUNT_DIR", str(tmp_path / "not-in-a-pod"))
    with pytest.raises(ConfigError, match="no cluster to deploy to"):
        call(mlflow_uri, version=version)
