"""The MLflow model registry as the release steps use it: connect, find a version by alias."""

from __future__ import annotations

from elastic_step.errors import ConfigError
from elastic_step.tracking.handover import step_tracking_uri
from elastic_step.tracking.run import TrackingError, connect

CHAMPION = "champion"
PREVIOUS_CHAMPION = "previous-champion"


def registry_client(mlflow_uri: str | None):
    """An MlflowClient for the pipeline's tracking server (the release steps share one)."""
    uri = step_tracking_uri(mlflow_uri)  # in a pipeline step: only the URI that came with its credentials
    if not uri:
        raise ConfigError("no MLflow tracking URI: pass --mlflow-uri (the component's mlflow_uri) "
                          "or set MLFLOW_TRACKING_URI to the server the training step used")
    return connect(uri, "")


def version_by_alias(client, name: str, alias: str):
    """The version `alias` points at, or None when the model or the alias does not exist yet."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            return None
        if exc.error_code == "PERMISSION_DENIED" and not model_exists(client, name):
            return None  # MLflow's basic auth answers 403, not 404, for the alias of a model not made yet
        raise


def get_version(client, name: str, version: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version(name, str(version))
    except MlflowException:
        known = [str(v.version) for v in client.search_model_versions(name_filter(name))] if model_exists(client, name) else []
        raise TrackingError(
            f"registered model {name!r} has no version {version!r}"
            + (f" (it has {', '.join(sorted(known, key=int))})" if known else " (the model is not registered)")
            + "; pass a version that export_model created"
        ) from None


def name_filter(name: str) -> str:
    """MLflow's search filter for the registered model `name`. MLflow's parser has no escapes: a
    name with a single quote is quoted with double quotes, else `name = 'it's'` is no filter at all
    (and a search that fails must not read as "not registered yet"). A name with both quotes
    cannot be searched for: refused in one line."""
    if "'" not in name:
        return f"name = '{name}'"
    if '"' not in name:
        return f'name = "{name}"'
    raise ConfigError(f"registered model name {name!r} holds both kinds of quote, which MLflow's search cannot "
                      "express: choose a name without one of them")


def model_exists(client, name: str) -> bool:
    """Whether `name` is a registered model this client may read: MLflow's basic auth answers 403,
    not 404, for a model not made yet, so any refusal counts as not there."""
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
        return True
    except MlflowException:
        return False
