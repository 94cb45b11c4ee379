"""deploy/serving's ValidatingAdmissionPolicy, judged by the cluster stand-in's admission (tests/
cluster/admission.py evaluates its CEL) as `kubectl apply -k deploy/` installs it.

RBAC lets the deploy step's account write Deployments, Services and InferenceServices with any pod
spec, and the server pods' account is a run parameter. What a platform engineer relies on:
- what `elastic-step deploy` renders for either target passes, canary and stable alike;
- a run that would serve as elastic-step-runner (whose token creates pods and Secrets), mount an API
  token, run another image, mount a Secret or a host path, share the node's network, or publish a
  Service that selects other pods is refused with the policy's own message, as a 403;
- other users are not judged by it.
"""

from __future__ import annotations

import copy
import os

import pytest

from cluster.admission import admit_by_policies
from cluster.objects import ApiError, Store
from cluster.rbac import REPO, read_manifests
from test_deploy_render import NAME, settings, store  # noqa: F401  (store: a fixture)

DEPLOYER = "system:serviceaccount:serving:elastic-step-deployer"
POLICY = "elastic-step-deployer-limits"


@pytest.fixture(scope="module")
def cluster_store():
    """A store holding what deploy/serving's kustomization ships of admission."""
    shipped = [o for o in read_manifests(os.path.join(REPO, "deploy", "serving"))
               if o["kind"].startswith("ValidatingAdmissionPolicy")]
    assert sorted(o["kind"] for o in shipped) == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    state = Store()
    for obj in shipped:
        with state.cond:
            state.commit("ADDED", "validatingadmissionpolicies" if obj["kind"] == "ValidatingAdmissionPolicy"
                         else "validatingadmissionpolicybindings", copy.deepcopy(obj))
    return state


def admit(state: Store, obj: dict, user: str = DEPLOYER, operation: str = "CREATE") -> None:
    group = obj["apiVersion"].rpartition("/")[0]
    plural = {"Deployment": "deployments", "Service": "services", "InferenceService": "inferenceservices"}[obj["kind"]]
    with state.cond:  # the API server holds the store's lock while it admits
        admit_by_policies(state, user, operation, group, plural, "serving", obj, None)


def refused(state: Store, obj: dict, user: str = DEPLOYER) -> str:
    with pytest.raises(ApiError) as denied:
        admit(state, obj, user)
    assert denied.value.body["code"] == 403, denied.value
    assert f"ValidatingAdmissionPolicy '{POLICY}'" in str(denied.value)
    return str(denied.value)


@pytest.fixture(scope="module")
def rendered(store):  # noqa: F811
    from elastic_step.release.deploy_render import Track, inference_service, model_deployment, model_service
    from elastic_step.release.served_model import resolve

    model = resolve(NAME, "champion", store["uri"])
    return {"stable": model_deployment(model, settings(), Track.STABLE),
            "canary": model_deployment(model, settings(), Track.CANARY, previous_version=store["v1"]),
            "service": model_service(model, settings()),
            "isvc": inference_service(model, settings(), canary=True, previous_version=store["v1"])}


def test_what_deploy_renders_passes_for_both_targets(cluster_store, rendered):
    for obj in rendered.values():
        admit(cluster_store, obj)
        admit(cluster_store, obj, operation="UPDATE")


def changed(obj: dict, path: str, value) -> dict:
    """A copy of `obj` with the dotted `path` set to `value` (a list index as a number)."""
    out = copy.deepcopy(obj)
    *parents, last = path.split(".")
    node = out
    for key in parents:
        node = node[int(key)] if key.isdigit() else node[key]
    node[int(last) if last.isdigit() else last] = value
    return out


POD = "spec.template.spec"


@pytest.mark.parametrize("which, path, value, says", [
    ("stable", f"{POD}.serviceAccountName", "elastic-step-runner", "may not run as elastic-step-runner"),
    ("canary", f"{POD}.automountServiceAccountToken", True, "may not mount an API token"),
    ("stable", f"{POD}.containers.0.image", "docker.io/attacker/miner:1", "image is not one this policy allows"),
    ("stable", f"{POD}.volumes", [{"name": "creds", "secret": {"secretName": "mlflow-credentials"}}], "no volume but emptyDir"),
    ("stable", f"{POD}.volumes", [{"name": "root", "hostPath": {"path": "/"}}], "no volume but emptyDir"),
    ("stable", f"{POD}.hostNetwork", True, "may not share the node's network"),
    ("isvc", "spec.predictor.serviceAccountName", "elastic-step-runner", "a predictor may not run as"),
    ("isvc", "spec.predictor.automountServiceAccountToken", True, "a predictor may not mount an API token"),
    ("service", "spec.selector", {"app.kubernetes.io/name": "elastic-step", "app.kubernetes.io/component": "master"},
     "selects model servers only"),
    ("service", "spec.type", "NodePort", "of type ClusterIP"),
])
def test_what_a_run_could_try_with_the_deployers_rights_is_refused(cluster_store, rendered, which, path, value, says):
    assert says in refused(cluster_store, changed(rendered[which], path, value))


def test_an_init_container_is_held_to_the_same_images_and_a_missing_setting_is_refused(cluster_store, rendered):
    sneaky = changed(rendered["stable"], f"{POD}.initContainers", [{"name": "fetch", "image": "busybox"}])
    assert "image is not one this policy allows" in refused(cluster_store, sneaky)
    no_setting = copy.deepcopy(rendered["isvc"])
    del no_setting["spec"]["predictor"]["automountServiceAccountToken"]
    assert "may not mount an API token" in refused(cluster_store, no_setting)


def test_other_users_are_not_judged(cluster_store, rendered):
    runner_pods = changed(rendered["stable"], f"{POD}.serviceAccountName", "elastic-step-runner")
    admit(cluster_store, runner_pods, user="system:serviceaccount:serving:cluster-admin-tool")
    admit(cluster_store, runner_pods, user="alice@example.com")
