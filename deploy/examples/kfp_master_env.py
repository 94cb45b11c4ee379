"""KFP: give the training step's pod (the elastic master) what the Kubernetes backend reads,
with kfp-kubernetes: its identity from the downward API (the shipped pipelines do the same), the
label deploy/mlflow's NetworkPolicy admits (the task's namespace must carry elastic-step/jobs=true
too: `kubectl label namespace kubeflow elastic-step/jobs=true`), and MLflow credentials from a Secret (keys
`username` and `password` of an MLflow user; never a literal).

    from kfp import dsl
    from kfp_master_env import as_elastic_master  # this file, or copy the function
    train = train_elastic(..., backend="kubernetes")
    as_elastic_master(train)
"""

from kfp import kubernetes

from elastic_step import defaults


def as_elastic_master(task, mlflow_credentials: str = "mlflow-pipelines", mlflow_uri: str = defaults.MLFLOW_SERVICE_URI):
    """`mlflow_uri`: deploy/mlflow's Service in MLflow's namespace unless told otherwise."""
    kubernetes.use_field_path_as_env(task, env_name="ELASTIC_STEP_POD_NAME", field_path="metadata.name")
    kubernetes.use_field_path_as_env(task, env_name="ELASTIC_STEP_POD_UID", field_path="metadata.uid")
    kubernetes.use_field_path_as_env(task, env_name="ELASTIC_STEP_POD_NAMESPACE", field_path="metadata.namespace")
    kubernetes.use_field_path_as_env(task, env_name="ELASTIC_STEP_POD_IP", field_path="status.podIP")
    kubernetes.add_pod_label(task, "app.kubernetes.io/part-of", "elastic-step")
    kubernetes.add_pod_label(task, *defaults.MLFLOW_CLIENT_LABEL)
    task.set_env_variable("MLFLOW_TRACKING_URI", mlflow_uri)
    kubernetes.use_secret_as_env(task, secret_name=mlflow_credentials, secret_key_to_env={
        "username": "MLFLOW_TRACKING_USERNAME", "password": "MLFLOW_TRACKING_PASSWORD"})
    return task
