import mlflow
import numpy as np
from mlflow.tracking import MlflowClient

from elastic_step.components import export_model

MODEL_DEF = "elastic_step.model_zoo.digits_torch"


def predict(model_uri: str, features: np.ndarray) -> np.ndarray:
    """What a serving stack does with a registered model: load it through its pyfunc flavour."""
    return np.asarray(mlflow.pyfunc.load_model(model_uri).predict(features))


def test_export_registers_torchscript_with_signature_tags_and_is_idempotent(trained, dataset, mlflow_uri):
    first = export_model.python_func(candidate=trained, dataset=dataset, registered_model="export-test",
                                     model_def=MODEL_DEF, mlflow_uri=mlflow_uri)
    assert first.registered_model_uri == f"models:/export-test/{first.model_version}"
    mlflow.set_tracking_uri(mlflow_uri)
    scripted = mlflow.pytorch.load_model(first.registered_model_uri)
    assert type(scripted).__name__ == "RecursiveScriptModule"  # TorchScript: loads without the model's code
    version = MlflowClient(mlflow_uri).get_model_version("export-test", first.model_version)
    assert version.tags["elastic_step.source_run_id"] == trained.metadata["mlflow_run_id"]
    assert abs(float(version.tags["test_accuracy"]) - trained.test_metrics["accuracy"]) < 1e-5
    assert len(version.tags["data_content_hash"]) == 64 and version.tags["framework"] == "pytorch"
    info = mlflow.models.get_model_info(first.registered_model_uri)
    assert info.signature is not None and info.saved_input_example_info is not None
    # the exported model computes what the trained one does
    example = np.random.default_rng(0).random((4, 64), dtype=np.float32)
    np.testing.assert_allclose(predict(first.registered_model_uri, example), predict(trained.metadata["model_uri"], example),
                               rtol=1e-5, atol=1e-5)
    # a retried export step finds its version instead of registering a second one
    again = export_model.python_func(candidate=trained, dataset=dataset, registered_model="export-test",
                                     model_def=MODEL_DEF, mlflow_uri=mlflow_uri)
    assert again.model_version == first.model_version
    assert len(MlflowClient(mlflow_uri).search_model_versions("name = 'export-test'")) == 1
