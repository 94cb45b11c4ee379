"""The master's permission pre-flight against the tests' API server (tests/cluster), which answers
SelfSubjectAccessReview, SelfSubjectRulesReview and SelfSubjectReview from its own RBAC
evaluation, as kube-apiserver does, with KFP's and Kubeflow's real roles loaded beside deploy/'s
(tests/cluster/platform/: their sources named there).

What a platform engineer relies on:
- a service account that lacks a right the master calls is refused before anything is created,
  in one line naming the account, its namespace and exactly the missing verbs and resources;
- KFP's `pipeline-runner` alone lacks exactly what deploy/kfp/single-user adds, and with it
  applied the master runs; a Kubeflow profile's `default-editor` needs nothing more than the
  workers' service account (deploy/kfp/multi-user);
- the reads KFP's launcher makes with the task pod's token (the `kfp-launcher` ConfigMap, the
  artifact store's Secret) are allowed to deploy/'s `elastic-step-runner`, and a missing store
  Secret is refused in one line naming it;
- deploy/'s Role is exactly the rights the backend's calls declare (rights.py)."""

from __future__ import annotations

import os

import pytest
import yaml
from kubernetes import client as k8s

from cluster import Cluster, role_rules
from cluster.rbac import REPO, read_manifests, read_platform
from elastic_step.backends.api import LaunchSpec
from elastic_step.backends.kubernetes import client as es_client
from elastic_step.backends.kubernetes.backend import KubernetesBackend
from elastic_step.backends.kubernetes.options import MasterPod, PodSettings
from elastic_step.backends.kubernetes.preflight import check_before_start
from elastic_step.backends.kubernetes.rights import MASTER_CALLS, Guarded, Right, kfp_rights, master_rights
from elastic_step.errors import ConfigError

pytestmark = pytest.mark.e2e

DEPLOY = os.path.join(REPO, "deploy")
PROFILE = "kubeflow-user-example-com"  # the profile namespace deploy/kfp/multi-user names
WHAT_THE_MASTER_CALLS = ("create, delete, patch configmaps; create, delete, get, list, watch pods; create, delete secrets; "
                         "create, delete networking.k8s.io/networkpolicies")


def overlay(folder: str) -> tuple[str, list[dict]]:
    """(namespace, objects) of a deploy/ kustomization, as `kubectl apply -k` would create them."""
    with open(os.path.join(folder, "kustomization.yaml"), encoding="utf-8") as f:
        namespace = yaml.safe_load(f).get("namespace")
    return namespace, read_manifests(folder)


def start_backend(cluster: Cluster, tmp_path, monkeypatch, namespace: str, account: str, kfp: bool = False,
                  pod: str = "train-step"):
    """The master's Kubernetes backend as it starts in a step pod of `account`: in-cluster
    configuration with that account's token (the real client), its pod's identity from the env."""
    folder = cluster.service_account_folder(str(tmp_path / f"sa-{account}"), namespace, account)
    for key, value in cluster.in_cluster_env(folder).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    if kfp:
        monkeypatch.setenv("KFP_POD_NAME", "train-step")  # what KFP's compiler gives a task's container
    else:
        monkeypatch.delenv("KFP_POD_NAME", raising=False)
    token = tmp_path / "job-token"
    token.write_text("job-token-value")
    master = MasterPod(name=pod, uid="", ip="127.0.0.1", namespace=namespace)
    # No step pod is made here (these tests are about rights), so no policy can select the master:
    # the explicit opt-out (test_kubernetes_backend.py tests the refusal without it).
    return KubernetesBackend(LaunchSpec("http://127.0.0.1:9", str(token), str(tmp_path)),
                             PodSettings(namespace=namespace, image="registry.example/none:1", master_network_policy=False),
                             "perm", master=master, watch_timeout_s=2)


def made_by_the_job(cluster: Cluster, namespace: str) -> list[str]:
    """Every object the master's backend makes (pods, its Secret, ConfigMap, NetworkPolicies)."""
    found = []
    for plural in ("pods", "secrets", "configmaps", "networkpolicies"):
        found += [f"{plural}/{o['metadata']['name']}" for o in cluster.objects(plural, namespace)
                  if (o["metadata"].get("labels") or {}).get("app.kubernetes.io/name") == "elastic-step"]
    return found


def store_secret(cluster: Cluster, namespace: str, name: str = "mlpipeline-minio-artifact") -> None:
    cluster.core().create_namespaced_secret(namespace, k8s.V1Secret(
        metadata=k8s.V1ObjectMeta(name=name), string_data={"accesskey": "minio", "secretkey": "not-a-real-secret"}))


# -- the API server's answers -----------------------------------------------------------------------

def test_the_api_server_answers_self_reviews_from_its_rbac(tmp_path):
    with Cluster(str(tmp_path / "cluster")) as cluster:
        ns = cluster.namespace
        runner = k8s.ApiClient(cluster.configuration(cluster.token_for(ns, cluster.service_account)))
        authz = k8s.AuthorizationV1Api(runner)

        def can(verb, resource, group="", name=None, namespace=ns):
            spec = k8s.V1SelfSubjectAccessReviewSpec(resource_attributes=k8s.V1ResourceAttributes(
                namespace=namespace, verb=verb, group=group, resource=resource, name=name))
            return authz.create_self_subject_access_review(k8s.V1SelfSubjectAccessReview(spec=spec)).status.allowed

        assert can("create", "pods") and can("delete", "networkpolicies", "networking.k8s.io")
        assert not can("get", "secrets") and not can("create", "pods", namespace="other")
        assert not can("delete", "networkpolicies")  # the core group has no networkpolicies
        # The launcher's reads: granted by deploy/kfp/launcher (part of deploy/) for those objects only.
        assert can("get", "configmaps", name="kfp-launcher") and can("get", "secrets", name="mlpipeline-minio-artifact")
        assert not can("get", "configmaps", name="other") and not can("list", "configmaps")

        rules = k8s.AuthorizationV1Api(runner).create_self_subject_rules_review(
            k8s.V1SelfSubjectRulesReview(spec=k8s.V1SelfSubjectRulesReviewSpec(namespace=ns))).status.resource_rules
        granted = {(g, r, v, tuple(rule.resource_names or ())) for rule in rules for g in rule.api_groups
                   for r in rule.resources for v in rule.verbs}
        assert ("", "secrets", "create", ()) in granted and ("", "secrets", "get", ("mlpipeline-minio-artifact",)) in granted
        assert ("authorization.k8s.io", "selfsubjectaccessreviews", "create", ()) in granted  # system:basic-user
        assert ("", "secrets", "get", ()) not in granted

        me = k8s.AuthenticationV1Api(runner).create_self_subject_review(k8s.V1SelfSubjectReview()).status.user_info
        assert me.username == cluster.service_account_user and f"system:serviceaccounts:{ns}" in me.groups

        # As kube-apiserver: a review with no attributes is invalid, a rules review needs a namespace.
        for call, body, status in ((authz.create_self_subject_access_review,
                                    k8s.V1SelfSubjectAccessReview(spec=k8s.V1SelfSubjectAccessReviewSpec()), 422),
                                   (authz.create_self_subject_rules_review,
                                    k8s.V1SelfSubjectRulesReview(spec=k8s.V1SelfSubjectRulesReviewSpec()), 400)):
            with pytest.raises(k8s.ApiException) as refused:
                call(body)
            assert refused.value.status == status, refused.value.body


def test_kubeflow_edit_aggregates_what_a_profiles_default_editor_may_do(tmp_path):
    with Cluster(str(tmp_path / "cluster"), namespace=PROFILE) as cluster:
        cluster.apply(read_platform("kubeflow-multi-user"), PROFILE)
        user = f"system:serviceaccount:{PROFILE}:default-editor"
        from cluster.rbac import Request

        allowed = lambda verb, resource, group="", ns=PROFILE: cluster.authorizer.allowed(user, Request(verb, group, resource, ns))  # noqa: E731
        assert allowed("create", "networkpolicies", "networking.k8s.io") and allowed("watch", "pods")
        assert allowed("create", "workflows", "argoproj.io")  # through kubeflow-pipelines-edit
        assert not allowed("create", "roles", "rbac.authorization.k8s.io") and not allowed("create", "pods", ns="other")


# -- one list of rights, in the code and in deploy/ ---------------------------------------------------

def test_deploys_master_role_is_exactly_the_rights_the_backends_calls_declare():
    role = next(o for o in read_manifests() if o["kind"] == "Role")
    granted = {Right(verb, group, resource) for rule in role["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    assert granted == set(master_rights())
    assert role_rules() == {(r.verb, r.resource) for r in master_rights()}
    # The backend reaches the API only through the declared calls.
    guarded = Guarded(k8s.CoreV1Api(k8s.ApiClient()), MASTER_CALLS)
    assert guarded.create_namespaced_pod
    with pytest.raises(AttributeError, match="rights.py"):
        guarded.read_namespaced_secret  # noqa: B018


def test_deploy_kfp_adds_exactly_what_kfps_roles_lack():
    runner = next(o for o in read_platform("kfp-single-user") if o["kind"] == "Role" and o["metadata"]["name"] == "pipeline-runner")
    from cluster.rbac import Request, Rule

    kfp_rules = [Rule.from_manifest(r) for r in runner["rules"]]
    namespace, objects = overlay(os.path.join(DEPLOY, "kfp", "single-user"))
    assert namespace == "kubeflow"
    master = [o for o in objects if o["kind"] == "Role" and o["metadata"]["name"] == "elastic-step-master-kfp"]
    added = {Right(verb, group, resource) for o in master for rule in o["rules"]
             for group in rule["apiGroups"] for resource in rule["resources"] for verb in rule["verbs"]}
    lacking = {r for r in master_rights() if not any(rule.allows(Request(r.verb, r.group, r.resource, namespace)) for rule in kfp_rules)}
    assert added == lacking  # nothing KFP already grants, nothing the master does not call
    binding = next(o for o in objects if o["kind"] == "RoleBinding" and o["metadata"]["name"] == "elastic-step-master-kfp")
    assert [s["name"] for s in binding["subjects"]] == ["pipeline-runner"]
    # Multi-user: default-editor's kubeflow-edit grants it all; only the workers' account is added.
    _, multi = overlay(os.path.join(DEPLOY, "kfp", "multi-user"))
    assert [(o["kind"], o["metadata"]["name"]) for o in multi] == [("ServiceAccount", "elastic-step-worker")]


# -- the pre-flight ---------------------------------------------------------------------------------

def test_under_kfps_pipeline_runner_alone_the_master_is_refused_with_exactly_what_is_missing(tmp_path, monkeypatch):
    with Cluster(str(tmp_path / "cluster"), namespace="kubeflow") as cluster:
        cluster.apply(read_platform("kfp-single-user"), "kubeflow")
        store_secret(cluster, "kubeflow")
        with pytest.raises(ConfigError) as refused:
            start_backend(cluster, tmp_path, monkeypatch, "kubeflow", "pipeline-runner", kfp=True)
        assert str(refused.value) == (
            'the service account "pipeline-runner" of namespace kubeflow may not create, delete, patch configmaps; '
            "create, delete secrets; create, delete networking.k8s.io/networkpolicies in namespace kubeflow, all of which "
            "the master calls: bind it a Role that grants them (deploy/rbac for elastic-step-runner; "
            "deploy/kfp/single-user for KFP's pipeline-runner, deploy/kfp/multi-user for a Kubeflow profile's default-editor)")
        assert made_by_the_job(cluster, "kubeflow") == []
        # The same line before the job opens its MLflow run (run_job's own pre-flight).
        with pytest.raises(ConfigError) as early:
            check_before_start("kubeflow")
        assert str(early.value) == str(refused.value)
        user = "system:serviceaccount:kubeflow:pipeline-runner"
        # It asked, read the launcher's configuration (for the store's Secret), and made nothing.
        assert cluster.refused(user) == set() and cluster.used(user) == {("get", "configmaps", "kubeflow")}

        # deploy/kfp/single-user applied: the same account runs the master.
        namespace, objects = overlay(os.path.join(DEPLOY, "kfp", "single-user"))
        cluster.apply(objects, namespace)
        backend = start_backend(cluster, tmp_path, monkeypatch, "kubeflow", "pipeline-runner", kfp=True)
        assert sorted(made_by_the_job(cluster, "kubeflow")) == sorted(
            [f"secrets/{backend.names.secret}", *(f"networkpolicies/{n}" for n in backend.network_policies)])
        backend.shutdown(grace_s=0)
        assert made_by_the_job(cluster, "kubeflow") == [] and cluster.refused(user) == set()


def test_a_kfp_task_whose_launcher_store_secret_is_missing_is_refused_naming_it(tmp_path, monkeypatch):
    with Cluster(str(tmp_path / "cluster"), namespace="kubeflow") as cluster:
        cluster.apply(read_platform("kfp-single-user"), "kubeflow")
        cluster.apply(overlay(os.path.join(DEPLOY, "kfp", "single-user"))[1], "kubeflow")
        with pytest.raises(ConfigError) as refused:
            start_backend(cluster, tmp_path, monkeypatch, "kubeflow", "pipeline-runner", kfp=True)
        assert str(refused.value).startswith(
            "the Secret 'mlpipeline-minio-artifact' that KFP's launcher uploads this task's outputs with is missing "
            "from namespace kubeflow"), refused.value
        # kfp-launcher names the store's Secret: that one is looked for, by its metadata only.
        providers = {"s3": {"default": {"endpoint": "s3.example:9000", "credentials": {
            "fromEnv": False, "secretRef": {"secretName": "team-store", "accessKeyKey": "a", "secretKeyKey": "s"}}}}}
        cluster.core().create_namespaced_config_map("kubeflow", k8s.V1ConfigMap(
            metadata=k8s.V1ObjectMeta(name="kfp-launcher"),
            data={"defaultPipelineRoot": "s3://team/pipelines", "providers": yaml.safe_dump(providers)}))
        with pytest.raises(ConfigError, match="the Secret 'team-store' that KFP's launcher"):
            start_backend(cluster, tmp_path, monkeypatch, "kubeflow", "pipeline-runner", kfp=True)
        store_secret(cluster, "kubeflow", "team-store")
        start_backend(cluster, tmp_path, monkeypatch, "kubeflow", "pipeline-runner", kfp=True).shutdown(grace_s=0)
        assert made_by_the_job(cluster, "kubeflow") == []


def test_a_profiles_default_editor_runs_the_master_with_deploy_kfp_multi_user(tmp_path, monkeypatch):
    with Cluster(str(tmp_path / "cluster"), namespace=PROFILE) as cluster:
        cluster.apply(read_platform("kubeflow-multi-user"), PROFILE)
        namespace, objects = overlay(os.path.join(DEPLOY, "kfp", "multi-user"))
        assert namespace == PROFILE
        cluster.apply(objects, PROFILE)
        store_secret(cluster, PROFILE)  # KFP's profile controller copies it into every profile namespace
        backend = start_backend(cluster, tmp_path, monkeypatch, PROFILE, "default-editor", kfp=True)
        assert made_by_the_job(cluster, PROFILE)
        backend.shutdown(grace_s=0)
        assert cluster.refused(f"system:serviceaccount:{PROFILE}:default-editor") == set()
        # The namespace's `default` account has no Role: every right is listed.
        with pytest.raises(ConfigError) as refused:
            start_backend(cluster, tmp_path, monkeypatch, PROFILE, "default", kfp=True)
        assert str(refused.value).startswith(
            f'the service account "default" of namespace {PROFILE} may not {WHAT_THE_MASTER_CALLS}; '
            "get configmaps 'kfp-launcher'; get secrets 'mlpipeline-minio-artifact' in namespace"), refused.value


def test_deploys_elastic_step_runner_may_make_the_kfp_launchers_reads(tmp_path, monkeypatch):
    """deploy/ says KFP tasks may run as elastic-step-runner: KFP's launcher reads kfp-launcher
    and the store Secret with that account's token, so deploy/ grants exactly those reads."""
    with Cluster(str(tmp_path / "cluster")) as cluster:
        ns = cluster.namespace
        with open(os.path.join(DEPLOY, "kustomization.yaml"), encoding="utf-8") as f:
            assert "kfp/launcher" in yaml.safe_load(f)["resources"]
        store_secret(cluster, ns)
        launcher_token = cluster.token_for(ns, cluster.service_account)  # the task pod's own token
        api = cluster.core(launcher_token)
        api.read_namespaced_secret("mlpipeline-minio-artifact", ns)
        with pytest.raises(k8s.ApiException) as absent:  # allowed, and absent: KFP falls back to its defaults
            api.read_namespaced_config_map("kfp-launcher", ns)
        assert absent.value.status == 404
        backend = start_backend(cluster, tmp_path, monkeypatch, ns, cluster.service_account, kfp=True)
        backend.shutdown(grace_s=0)
        assert cluster.refused() == set()
        rights = {(r.verb, r.resource, r.name) for r in kfp_rights("mlpipeline-minio-artifact")}
        assert rights == {("get", "configmaps", "kfp-launcher"), ("get", "secrets", "mlpipeline-minio-artifact")}


def test_an_optional_mlflow_secret_that_is_missing_is_let_through_and_a_required_one_is_refused_naming_it(tmp_path, monkeypatch):
    """KFP's `use_secret_as_env(..., optional=True)` (the compiled pipelines' own): without the
    Secret Kubernetes starts the pod with the variable unset, which is right for an MLflow
    without auth, so the master starts. A reference not marked optional that this process lacks
    is refused in one line naming the Secret and key, before anything is created."""
    with Cluster(str(tmp_path / "cluster")) as cluster:
        ns = cluster.namespace

        def step_pod(name: str, optional: bool | None) -> None:  # the step's pod, as the API server holds it
            ref = k8s.V1SecretKeySelector(name="mlflow-pipelines", key="password", optional=optional)
            cluster.core().create_namespaced_pod(ns, k8s.V1Pod(
                metadata=k8s.V1ObjectMeta(name=name),
                spec=k8s.V1PodSpec(restart_policy="Never", service_account_name=cluster.service_account, containers=[
                    k8s.V1Container(name="main", image="registry.example/none:1", env=[k8s.V1EnvVar(
                        name="MLFLOW_TRACKING_PASSWORD", value_from=k8s.V1EnvVarSource(secret_key_ref=ref))])])))

        step_pod("optional-step", optional=True)
        step_pod("required-step", optional=None)
        monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)  # what the kubelet leaves out
        monkeypatch.setenv("ELASTIC_STEP_POD_NAMESPACE", ns)
        monkeypatch.setenv("ELASTIC_STEP_POD_NAME", "optional-step")
        start_backend(cluster, tmp_path, monkeypatch, ns, cluster.service_account, pod="optional-step").shutdown(grace_s=0)
        check_before_start(ns)  # the in-cluster configuration start_backend set
        assert made_by_the_job(cluster, ns) == []

        expected = ("the Secret 'mlflow-pipelines' (key 'password') that gives this pod MLFLOW_TRACKING_PASSWORD is "
                    f"missing from namespace {ns}: create it with the MLflow user's credentials (docs/kubernetes.md, "
                    "MLflow on the cluster)")
        monkeypatch.setenv("ELASTIC_STEP_POD_NAME", "required-step")
        with pytest.raises(ConfigError) as refused:
            start_backend(cluster, tmp_path, monkeypatch, ns, cluster.service_account, pod="required-step")
        assert str(refused.value) == expected
        with pytest.raises(ConfigError) as early:
            check_before_start(ns)
        assert str(early.value) == expected
        assert made_by_the_job(cluster, ns) == []


def test_a_cluster_that_withholds_the_reviews_skips_the_preflight_and_the_calls_still_say_what_fails(tmp_path, monkeypatch, caplog):
    """Without `system:basic-user` an account may not ask what it may do: the pre-flight steps
    aside (a warning), and the master runs on the rights it has."""
    from cluster.rbac import BASIC_USER

    with Cluster(str(tmp_path / "cluster")) as cluster:
        cluster.authorizer.bindings = [b for b in cluster.authorizer.bindings if b[2] != BASIC_USER]
        backend = start_backend(cluster, tmp_path, monkeypatch, cluster.namespace, cluster.service_account)
        assert made_by_the_job(cluster, cluster.namespace)
        backend.shutdown(grace_s=0)
        assert "permission pre-flight skipped" in caplog.text
        assert {r for _, r, _ in cluster.refused()} == {"selfsubjectaccessreviews"}
