from typing import NamedTuple

from kfp import dsl

from elastic_step.images import default_image


@dsl.component(base_image=default_image(), install_kfp_package=False)
def promote_model(
    registered_model: str,
    version: str,
    mlflow_uri: str = "",
) -> NamedTuple("PromoteOutputs", [("champion_version", str), ("previous_champion_version", str)]):
    """Move the registry alias `champion` to a version; the former champion keeps
    `previous-champion` so `elastic-step promote --rollback` can move them back.

    Idempotent: promoting the version that is already champion changes nothing.

    Args:
        registered_model: Name of the model in the MLflow registry.
        version: The version to promote (export_model's model_version).
        mlflow_uri: Tracking URI (default: MLFLOW_TRACKING_URI).

    Returns:
        champion_version: The version @champion points at now.
        previous_champion_version: The version @previous-champion points at ("" when none).
    """
    from collections import namedtuple

    from elastic_step.release.promote import promote

    result = promote(registered_model, version, mlflow_uri=mlflow_uri or None)
    print(result.describe())
    return namedtuple("PromoteOutputs", ["champion_version", "previous_champion_version"])(
        result.champion, result.previous_champion or "")
