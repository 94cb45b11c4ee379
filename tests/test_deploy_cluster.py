"""`elastic-step deploy` against the cluster stand-in (tests/cluster: an HTTPS API server with
RBAC): what it refuses before anything is written, through the real `kubernetes` client and a
kubeconfig, as a user at a shell runs it. The stand-in serves no InferenceService API (no KServe
installed), as a cluster without KServe answers: 404 for the group."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml
from kubernetes import client as k8s
from mlflow.tracking import MlflowClient

from cluster import KUBELET_USER, SCHEDULER_USER, Cluster
from cluster.kserve import GROUP as KSERVE_GROUP
from elastic_step.errors import ConfigError
from elastic_step.tracking.run import TrackingError
from registered_models import make_store, register_linear

NAME = "digits"
WRITES = {"create", "update", "patch", "delete", "deletecollection"}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    uri = make_store(str(tmp_path_factory.mktemp("registry")))
    version = register_linear(uri, NAME, seed=1)
    MlflowClient(uri).set_registered_model_alias(NAME, "champion", version)
    return uri


@pytest.fixture
def cluster(tmp_path):
    with Cluster(str(tmp_path / "cluster")) as c:
        yield c


def kubeconfig(cluster, folder) -> str:
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "admin",
        "clusters": [{"name": "stand-in", "cluster": {"server": cluster.server.url, "certificate-authority": cluster.ca}}],
        "users": [{"name": "admin", "user": {"token": cluster.admin_token}}],
        "contexts": [{"name": "admin", "context": {"cluster": "stand-in", "user": "admin", "namespace": cluster.namespace}}],
    }
    path = os.path.join(str(folder), "kubeconfig")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    os.chmod(path, 0o600)
    return path


def serving_account(cluster, secret: bool = True) -> None:
    api = cluster.core()
    api.create_namespaced_service_account(cluster.namespace, k8s.V1ServiceAccount(metadata=k8s.V1ObjectMeta(name="model-server")))
    if secret:
        api.create_namespaced_secret(cluster.namespace, k8s.V1Secret(metadata=k8s.V1ObjectMeta(name="model-store"),
                                                                     string_data={"AWS_ACCESS_KEY_ID": "k"}))


def deploy(cluster, store, target="mlflow", namespace=None, **kwargs):
    from elastic_step.release.deploy import deploy_model
    from elastic_step.release.deploy_render import DeploySettings

    settings = DeploySettings(namespace=namespace or cluster.namespace, name=NAME, service_account="model-server",
                              storage_secret="model-store", image="registry.example/server:1")
    return deploy_model(registered_model=NAME, settings=settings, target=target, mlflow_uri=store, timeout=30,
                        api_client=k8s.ApiClient(cluster.configuration()), **kwargs)


def writes_since(cluster, mark: int) -> list:
    """The writes the API server recorded after `mark` (an index into its audit)."""
    return [entry for entry in cluster.server.audit[mark:] if entry[1] in WRITES]


def asked_since(cluster, mark: int) -> list:
    """The requests the API server recorded after `mark`, but for the stand-in's own scheduler
    and kubelet, which list and watch pods on their own clock whatever a test does."""
    return [entry for entry in cluster.server.audit[mark:] if entry[0] not in (SCHEDULER_USER, KUBELET_USER)]


def test_deploy_at_a_shell_refuses_a_cluster_without_kserve_in_one_line(cluster, store, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "MLFLOW_"))}
    serving_account(cluster)
    mark = len(cluster.server.audit)
    done = subprocess.run([sys.executable, "-m", "elastic_step.cli", "deploy", "--registered-model", NAME, "--alias", "champion",
                           "--target", "kserve", "--namespace", cluster.namespace, "--service-account", "model-server",
                           "--storage-secret", "model-store", "--mlflow-uri", store],
                          capture_output=True, text=True, env={**env, "KUBECONFIG": kubeconfig(cluster, tmp_path)}, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "elastic-step deploy: error: the cluster has no InferenceService API (serving.kserve.io/v1beta1): install KServe, "
        "or deploy with --target mlflow (a plain Deployment of MLflow's model server)")
    assert writes_since(cluster, mark) == []


@pytest.mark.parametrize("target, setup, says", [
    ("kserve", "all", "the cluster has no InferenceService API (serving.kserve.io/v1beta1)"),
    ("mlflow", "none", "service account 'model-server' in namespace '{ns}' does not exist"),
    ("mlflow", "no-secret", "Secret 'model-store' in namespace '{ns}' does not exist"),
])
def test_deploy_refuses_what_the_cluster_lacks_before_writing_anything(cluster, store, target, setup, says):
    if setup != "none":
        serving_account(cluster, secret=setup == "all")
    mark = len(cluster.server.audit)
    with pytest.raises(ConfigError, match=re.escape(says.format(ns=cluster.namespace))):
        deploy(cluster, store, target, alias="champion")
    assert writes_since(cluster, mark) == []
    if target == "mlflow":  # it asked the cluster (the stand-in routes no unknown group to its audit)
        assert ("system:admin", "get", "serviceaccounts", cluster.namespace, True) in cluster.server.audit[mark:]


def test_deploy_refuses_a_namespace_that_does_not_exist(cluster, store):
    with pytest.raises(ConfigError, match="namespace 'nowhere' does not exist"):
        deploy(cluster, store, namespace="nowhere", alias="champion")


@pytest.mark.parametrize("target", ["mlflow", "kserve"])
def test_a_rollback_with_no_previous_revision_is_refused(cluster, store, target):
    serving_account(cluster)
    if target == "kserve":
        cluster.server.install(KSERVE_GROUP)  # KServe's API served, no InferenceService yet
    mark = len(cluster.server.audit)
    with pytest.raises(ConfigError, match=f"{cluster.namespace}/{NAME} has no previous revision to roll back to"):
        deploy(cluster, store, target, rollback=True)
    assert writes_since(cluster, mark) == []


@pytest.mark.parametrize("which, says", [
    ({"alias": "nope"}, f"registered model '{NAME}' has no alias @nope"),
    ({"version": "99"}, f"registered model '{NAME}' has no version '99'"),
])
def test_an_unknown_alias_or_version_is_refused_before_the_cluster_is_asked(cluster, store, which, says):
    serving_account(cluster)
    mark = len(cluster.server.audit)
    with pytest.raises(TrackingError, match=re.escape(says)):  # a bad input: the CLI's exit 2
        deploy(cluster, store, "mlflow", **which)
    assert asked_since(cluster, mark) == []  # resolved through the registry first: no request at all
