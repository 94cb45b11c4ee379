"""Small registered models for the serving tests: a traced torch Linear logged the way export_model
logs a serving model (pytorch flavour, signature, input example) into a real MLflow store, so
that `mlflow models serve` and KServe's MLflow runtime have what they would have in production."""

from __future__ import annotations

import os

import numpy as np

FEATURES = 4


def make_store(folder: str) -> str:
    """A SQLite tracking store whose artifacts stay under `folder` (not the working directory)."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{os.path.join(folder, 'mlflow.db')}"
    client = MlflowClient(uri)
    client.create_experiment("serving", artifact_location=os.path.join(folder, "artifacts"))
    return uri


def rows(n: int = 5, seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, FEATURES)).astype(np.float32)


def register_linear(uri: str, name: str, seed: int, signature: bool = True) -> str:
    """Log a Linear(4, 3) with weights from `seed` and register it; returns the version."""
    import mlflow
    import mlflow.pytorch
    import torch
    from mlflow.models import infer_signature

    from elastic_step.tracking.uri import use_tracking_uri

    torch.manual_seed(seed)
    net = torch.nn.Linear(FEATURES, 3).eval()
    example = rows(3)
    traced = torch.jit.trace(net, torch.from_numpy(example))
    use_tracking_uri(uri)
    # Not mlflow.set_experiment: it would leave the experiment active in this process, and MLflow
    # then refuses to reopen a run of another experiment by its id (a later test's training step).
    client = mlflow.MlflowClient()
    experiment = client.get_experiment_by_name("serving")
    with mlflow.start_run(experiment_id=experiment.experiment_id if experiment else client.create_experiment("serving")):
        info = mlflow.pytorch.log_model(
            traced, name="serving-model", serialization_format="pickle",
            signature=infer_signature(example, net(torch.from_numpy(example)).detach().numpy()) if signature else None,
            input_example=example if signature else None,
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"])
    return str(mlflow.register_model(info.model_uri, name).version)


def predict(uri: str, model_uri: str, data: np.ndarray) -> np.ndarray:
    """The registered model's own predictions, loaded in the test's process."""
    import mlflow.pyfunc

    from elastic_step.tracking.uri import use_tracking_uri

    use_tracking_uri(uri)
    return np.asarray(mlflow.pyfunc.load_model(model_uri).predict(data))
