from typing import NamedTuple

from kfp import dsl
from kfp.dsl import Dataset, Input, Model

from elastic_step.images import default_image


@dsl.component(base_image=default_image(), install_kfp_package=False)
def export_model(
    candidate: Input[Model],
    dataset: Input[Dataset],
    registered_model: str,
    model_def: str,
    mlflow_uri: str = "",
    pipeline_run_id: str = "",
) -> NamedTuple("ExportOutputs", [("model_version", str), ("registered_model_uri", str)]):
    """Log the candidate in its serving format and register it as a new version of the model.

    PyTorch models are exported as TorchScript, Keras models as a TensorFlow SavedModel; each
    with a signature and an input example from the test split. The version is tagged with the
    test metrics, the data's content hash, the training run and the pipeline run. A retried
    export finds the version it registered before instead of registering a second one.

    Args:
        candidate: The trained (and blessed) model from train_elastic.
        dataset: The prepared data (the input example comes from its test split).
        registered_model: Name of the model in the MLflow registry.
        model_def: The model definition the candidate was trained with (the pipeline's model_def), whose network the weights are loaded into; the training run's own model_def parameter is never used.
        mlflow_uri: Tracking URI (default: MLFLOW_TRACKING_URI).
        pipeline_run_id: The pipeline run, recorded on the version (default: KFP_RUN_ID / ARGO_WORKFLOW_NAME).

    Returns:
        model_version: The registered version.
        registered_model_uri: `models:/NAME/VERSION`.
    """
    from collections import namedtuple

    from elastic_step.release.export import export_model as export

    result = export(run_id=candidate.metadata["mlflow_run_id"], model_uri=candidate.metadata.get("model_uri", ""),
                    data=dataset.path, registered_model=registered_model, mlflow_uri=mlflow_uri or None,
                    pipeline_run=pipeline_run_id, model_def=model_def)
    return namedtuple("ExportOutputs", ["model_version", "registered_model_uri"])(result.version, result.registered_model_uri)
