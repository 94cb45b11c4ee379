"""KFP: give the training step's pod (the elastic master) what the Kubernetes backend reads,
with kfp-kubernetes. KFP itself sets KFP_POD_NAME and KFP_POD_UID, which the backend also
accepts; the pod IP and namespace come from the downward API here.

    from kfp import dsl
    from kfp_master_env import as_elastic_master  # this file, or copy the function
    train = train_elastic(..., backend="kubernetes")
    as_elastic_master(train)
"""

from kfp import kubernetes


def as_elastic_master(task, service_account: str = "elastic-step-runner"):
    kubernetes.use_field_path_as_env(task, env_name="ELASTIC_STEP_POD_NAME", field_path="metadata.name")
    kubernetes.use_field_path_as_env(task, env_name="ELASTIC_STEP_POD_UID", field_path="metadata.uid")
    kubernetes.use_field_path_as_env(task, env_name="ELASTIC_STEP_POD_NAMESPACE", field_path="metadata.namespace")
    kubernetes.use_field_path_as_env(task, env_name="ELASTIC_STEP_POD_IP", field_path="status.podIP")
    task.set_env_variable("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    return task
