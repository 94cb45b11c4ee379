from typing import NamedTuple

from kfp import dsl

from elastic_step.images import default_image


@dsl.component(base_image=default_image(), install_kfp_package=False)
def deploy_model(
    registered_model: str,
    namespace: str,
    service_account: str,
    storage_secret: str,
    alias: str = "",
    version: str = "",
    target: str = "mlflow",
    name: str = "",
    canary_percent: int = 10,
    replicas: int = 1,
    timeout_seconds: int = 300,
    image: str = "",
    serving_mlflow_uri: str = "",
    mlflow_uri: str = "",
) -> NamedTuple("DeployOutputs", [("endpoint", str), ("served_version", str)]):
    """Serve a registered model version on the cluster: a KServe InferenceService (target
    `kserve`) or a Deployment and Service of MLflow's model server (target `mlflow`), with the
    version and its artifact location resolved through the MLflow registry.

    When a previous revision serves, the new version starts as a canary with `canary_percent` of
    the traffic and takes all of it once Ready; if it is not Ready within `timeout_seconds`, or
    sooner its server exits or cannot start (KServe: the revision failed), the traffic goes back
    to the previous revision and the step fails with the reason. Refused before
    anything is written (exit code 2): an unknown alias or version, a version without a
    signature, a cluster without KServe (target kserve), a namespace without the service account
    or the Secret.

    Args:
        registered_model: Name of the model in the MLflow registry.
        namespace: Namespace to serve in.
        service_account: The server pods' service account (KServe reads the store's credentials through its Secrets).
        storage_secret: The Secret holding the model store's credentials.
        alias: The alias to deploy (e.g. champion), resolved to its version once; or give version.
        version: The version to deploy (export_model's model_version); or give alias.
        target: kserve (an InferenceService) or mlflow (MLflow's model server in a Deployment).
        name: InferenceService / Service name (default: from the model's name).
        canary_percent: Traffic for a new version while a previous one serves, until it is Ready.
        replicas: Server replicas.
        timeout_seconds: How long to wait for Ready before rolling back.
        image: The mlflow target's server image (default: this component's image).
        serving_mlflow_uri: The registry as the server pods reach it (default: mlflow_uri without credentials).
        mlflow_uri: Tracking URI (default: MLFLOW_TRACKING_URI).

    Returns:
        endpoint: The URL the served model answers on.
        served_version: The registered version now serving.
    """
    import os
    from collections import namedtuple

    from elastic_step.cli.deploy import without_credentials
    from elastic_step.images import default_image as image_default
    from elastic_step.release.deploy import deploy_model as deploy
    from elastic_step.release.deploy_render import DeploySettings, object_name

    registry = mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    settings = DeploySettings(namespace=namespace, name=name or object_name(registered_model), service_account=service_account,
                              storage_secret=storage_secret, mlflow_uri=serving_mlflow_uri or without_credentials(registry),
                              image=image or image_default(), replicas=replicas, canary_percent=canary_percent)
    result = deploy(registered_model=registered_model, settings=settings, alias=alias, version=version, target=target,
                    timeout=float(timeout_seconds), mlflow_uri=mlflow_uri or None)
    print(result.describe())
    return namedtuple("DeployOutputs", ["endpoint", "served_version"])(result.endpoint, result.version)
