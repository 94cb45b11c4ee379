"""The deploy step's rights (deploy/serving): what `elastic-step deploy` calls is granted to its
own service account, elastic-step-deployer, and to nobody else of deploy/'s; the training steps'
elastic-step-runner gets none of it, and the deployer none of the runner's. The rendered Argo
deploy template runs as the deployer; KFP's single-user overlay grants pipeline-runner the rest.

The rights are read from deploy_apply.py's client calls, so a call added there without its right
in the Role (or a right left in the Role that no call uses) fails here. They are evaluated by the
cluster stand-in's RBAC (tests/cluster/rbac.py) over the manifests as `kubectl apply -k` makes
them, with no API server started."""

from __future__ import annotations

import ast
import os

import pytest
import yaml

from cluster.rbac import REPO, Authorizer, Request, kustomize_namespace, read_manifests, read_platform, service_account_user
from conftest import cli
from elastic_step.argo import RenderOptions
from elastic_step.argo.render import render_texts
from elastic_step.backends.kubernetes.rights import master_rights
from elastic_step.errors import ConfigError
from elastic_step.release import deploy_apply

DEPLOY = os.path.join(REPO, "deploy")
NAMESPACE = "ml"  # deploy/kustomization.yaml's
DEPLOYER, RUNNER = (service_account_user(NAMESPACE, n) for n in ("elastic-step-deployer", "elastic-step-runner"))
# The kubernetes client's method names: verb prefix and resource suffix -> RBAC's verb and (group, resource).
VERBS = {"read": "get", "get": "get", "list": "list", "create": "create", "replace": "update", "patch": "patch",
         "delete": "delete"}
RESOURCES = {"namespace": ("", "namespaces"), "namespaced_service_account": ("", "serviceaccounts"),
             "namespaced_secret": ("", "secrets"), "namespaced_service": ("", "services"), "namespaced_pod": ("", "pods"),
             "namespaced_deployment": ("apps", "deployments"),
             # ServingCluster's custom objects are KServe's, all of them
             "namespaced_custom_object": (deploy_apply.KSERVE_GROUP, deploy_apply.KSERVE_PLURAL)}


def deploy_calls() -> set[tuple[str, str, str]]:
    """(verb, group, resource) of every client method ServingCluster calls or passes on to be
    called (`self.core.read_namespace`), read from its source."""
    with open(deploy_apply.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    found, raw = set(), set()
    for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        for node in ast.walk(function):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"):
                continue
            if node.value.attr == "api_client" and node.attr == "call_api":
                raw.add(function.name)
            if node.value.attr not in ("core", "apps", "custom"):
                continue
            verb, _, resource = node.attr.partition("_")
            assert verb in VERBS and resource in RESOURCES, (
                f"ServingCluster calls {node.attr}: add its right here and to deploy/serving/role.yaml")
            found.add((VERBS[verb], *RESOURCES[resource]))
    # The one raw request is discovery (GET /apis/serving.kserve.io/v1beta1), which every
    # authenticated user may make (system:discovery): no Role grants it.
    assert raw == {"_serves_group"}
    return found


def granted(objects: list[dict], role: str) -> set[tuple[str, str, str]]:
    (rules,) = [o["rules"] for o in objects if o["kind"] == "Role" and o["metadata"]["name"] == role]
    return {(verb, group, resource) for r in rules for group in r["apiGroups"] for resource in r["resources"]
            for verb in r["verbs"]}


def authorizer(objects: list[dict], namespace: str) -> Authorizer:
    """RBAC as the API server has it after `kubectl apply -k` of `objects` into `namespace`."""
    rbac = Authorizer()
    for obj in kustomize_namespace(objects, namespace):
        rbac.apply(obj)
    return rbac


def request(verb: str, group: str, resource: str, namespace: str) -> Request:
    # GET /api/v1/namespaces/NAME: RBAC takes the request's namespace to be NAME itself
    # (apiserver's RequestInfo), so a Role in NAME grants that read and no other namespace's.
    return Request(verb, group, resource, namespace, namespace if resource == "namespaces" else "model")


def test_the_deployer_role_grants_exactly_what_the_deploy_calls():
    calls = deploy_calls()
    assert ("create", "apps", "deployments") in calls and ("patch", "serving.kserve.io", "inferenceservices") in calls
    serving = read_manifests(os.path.join(DEPLOY, "serving"))
    assert granted(serving, "elastic-step-deployer") == calls
    assert not [o for o in serving if o["kind"].startswith("Cluster")]


def test_only_the_deployer_may_deploy_and_it_may_do_nothing_of_the_runners():
    rbac = authorizer(read_manifests(DEPLOY), NAMESPACE)  # everything deploy/ ships
    # the one call both make: listing pods (the master its workers, the deploy its servers while it waits)
    shared = {(r.verb, r.group, r.resource) for r in master_rights()} & deploy_calls()
    assert shared == {("list", "", "pods")}, shared
    for call in sorted(deploy_calls()):
        assert rbac.allowed(DEPLOYER, request(*call, NAMESPACE)), call
        if call not in shared:
            assert not rbac.allowed(RUNNER, request(*call, NAMESPACE)), call  # the training steps' token
        assert not rbac.allowed(DEPLOYER, request(*call, "other")), call  # its own namespace only
    for right in master_rights():  # worker pods, job Secrets, status ConfigMaps, NetworkPolicies
        if (right.verb, right.group, right.resource) not in shared:
            assert not rbac.allowed(DEPLOYER, Request(right.verb, right.group, right.resource, NAMESPACE, "job")), right
    # Argo's executor reports the deploy step's outputs with the deployer's token.
    for verb in ("create", "patch"):
        assert rbac.allowed(DEPLOYER, Request(verb, "argoproj.io", "workflowtaskresults", NAMESPACE, "step"))


def test_kfp_single_user_adds_exactly_what_pipeline_runner_lacks_to_deploy():
    overlay = read_manifests(os.path.join(DEPLOY, "kfp", "single-user"))
    rbac = authorizer(read_platform("kfp-single-user") + overlay, "kubeflow")
    runner = service_account_user("kubeflow", "pipeline-runner")
    assert all(rbac.allowed(runner, request(*call, "kubeflow")) for call in deploy_calls())
    kfp_only = authorizer(read_platform("kfp-single-user"), "kubeflow")
    lacking = {call for call in deploy_calls() if not kfp_only.allowed(runner, request(*call, "kubeflow"))}
    assert granted(overlay, "elastic-step-deployer-kfp") == lacking


@pytest.mark.parametrize("name", ["training", "retraining"])
def test_the_compiled_deploy_step_alone_runs_as_the_deployer(name):
    with open(os.path.join(REPO, "pipelines", "argo", f"{name}-workflowtemplate.yaml"), encoding="utf-8") as f:
        spec = yaml.safe_load(f)["spec"]
    assert spec["serviceAccountName"] == "elastic-step-runner"
    accounts = {t["name"]: t.get("serviceAccountName") for t in spec["templates"]}
    assert accounts.pop("deploy") == "elastic-step-deployer"
    assert set(accounts.values()) == {None}  # every other step: the workflow's runner


def test_the_deploy_steps_account_is_a_render_flag_checked_before_anything_is_written(tmp_path):
    texts = render_texts(["retraining"], RenderOptions(deploy_service_account="team-deployer"))
    spec = yaml.safe_load(texts["retraining-workflowtemplate.yaml"])["spec"]
    assert [t.get("serviceAccountName") for t in spec["templates"] if t["name"] == "deploy"] == ["team-deployer"]
    with pytest.raises(ConfigError, match="--deploy-service-account 'Team_Deployer' is not a valid Kubernetes name"):
        render_texts(["retraining"], RenderOptions(deploy_service_account="Team_Deployer"))
    done = cli("argo", "render", "--pipeline", "retraining", "--out", str(tmp_path / "out"), "--deploy-service-account", "Team_Deployer", timeout=120)
    assert done.returncode == 2 and "--deploy-service-account 'Team_Deployer'" in done.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()
