"""KFP: give the training step's pod (the elastic master) what the Kubernetes backend reads,
with kfp-kubernetes: its identity from the downward API (the shipped pipelines do the same), the
label deploy/mlflow's NetworkPolicy admits (the task's namespace must carry elastic-step/jobs=true
too: `kubectl label namespace kubeflow elastic-step/jobs=true`), and MLflow's address and user
from one Secret (keys `uri`, `username` and `password` of an MLflow user; never a literal). The
URI comes from the same Secret as the password, never from a pipeline parameter: whoever submits a
run sets those, and could point the step at a host that collects the password.

    kubectl create secret generic mlflow-credentials \\
        --from-literal=uri=http://mlflow.<MLflow's namespace>.svc.cluster.local:5000 \\
        --from-literal=username=pipelines --from-literal=password=...

    from kfp import dsl
    from kfp_master_env import as_elastic_master  # this file, or copy the function
    train = train_elastic(..., backend="kubernetes")  # mlflow_uri left empty
    as_elastic_master(train)
"""

from kfp import kubernetes

from elastic_step import defaults

# The shipped pipelines' Secret and keys (pipelines/lifecycle.py).
MLFLOW_SECRET_KEYS = {"uri": "MLFLOW_TRACKING_URI", "username": "MLFLOW_TRACKING_USERNAME",
                      "password": "MLFLOW_TRACKING_PASSWORD"}


def as_elastic_master(task, mlflow_credentials: str = "mlflow-credentials"):
    """`mlflow_credentials`: the Secret's name, fixed when the pipeline is compiled."""
    kubernetes.use_field_path_as_env(task, env_name="ELASTIC_STEP_POD_NAME", field_path="metadata.name")
    kubernetes.use_field_path_as_env(task, env_name="ELASTIC_STEP_POD_UID", field_path="metadata.uid")
    kubernetes.use_field_path_as_env(task, env_name="ELASTIC_STEP_POD_NAMESPACE", field_path="metadata.namespace")
    kubernetes.use_field_path_as_env(task, env_name="ELASTIC_STEP_POD_IP", field_path="status.podIP")
    kubernetes.add_pod_label(task, "app.kubernetes.io/part-of", "elastic-step")
    kubernetes.add_pod_label(task, *defaults.MLFLOW_CLIENT_LABEL)
    kubernetes.use_secret_as_env(task, secret_name=mlflow_credentials, secret_key_to_env=MLFLOW_SECRET_KEYS)
    return task
