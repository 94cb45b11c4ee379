"""What `deploy` writes, checked against the real systems' own schemas before any cluster sees it:
the InferenceService against KServe's published CRD schema (tests/schemas/README.md), with no
field the API server would prune; the Deployment and Service against Kubernetes' OpenAPI schema
(kubernetes-validate, strict). And the bad input refused in one line, exit 2, before anything."""

from __future__ import annotations

import json
import os

import jsonschema
import kubernetes_validate
import pytest
import yaml
from mlflow.tracking import MlflowClient

from registered_models import make_store, register_linear

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KSERVE_SCHEMA = os.path.join(ROOT, "tests", "schemas", "kserve-inferenceservice-v0.20.0.schema.json")
NAME = "Digits Classifier"  # a registry name that is no valid Kubernetes name nor label


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    uri = make_store(str(tmp_path_factory.mktemp("registry")))
    versions = {"v1": register_linear(uri, NAME, seed=1), "v2": register_linear(uri, NAME, seed=2),
                "unsigned": register_linear(uri, NAME, seed=3, signature=False)}
    MlflowClient(uri).set_registered_model_alias(NAME, "champion", versions["v2"])
    return {"uri": uri, **versions}


def settings(**overrides):
    from elastic_step.release.deploy_render import DeploySettings

    return DeploySettings(**{"namespace": "serving", "name": "digits", "service_account": "model-server",
                             "storage_secret": "model-store", "mlflow_uri": "http://mlflow.ml.svc.cluster.local:5000",
                             "image": "ghcr.io/elastic-step/elastic-step-torch:0.1.0", **overrides})


def never_pruned(obj, schema, where="") -> list[str]:
    """Fields of `obj` that a structural schema does not name: the API server drops them silently
    (a typo would vanish instead of failing), so none may be rendered."""
    if isinstance(obj, list):
        return [p for i, item in enumerate(obj) for p in never_pruned(item, schema.get("items", {}), f"{where}[{i}]")]
    if not isinstance(obj, dict) or schema.get("x-kubernetes-preserve-unknown-fields") or where == ".metadata":
        return []
    if "additionalProperties" in schema:
        return [p for key, value in obj.items() for p in never_pruned(value, schema["additionalProperties"], f"{where}.{key}")]
    known = schema.get("properties", {})
    return [f"{where}.{key}" for key in obj if key not in known] + [
        p for key, value in obj.items() if key in known for p in never_pruned(value, known[key], f"{where}.{key}")]


@pytest.mark.parametrize("canary", [False, True])
def test_the_inference_service_validates_against_kserves_own_crd_schema(store, canary):
    from elastic_step.release.deploy_render import inference_service
    from elastic_step.release.served_model import resolve

    model = resolve(NAME, "champion", store["uri"])
    isvc = inference_service(model, settings(), canary=canary, previous_version=store["v1"] if canary else "")
    schema = json.load(open(KSERVE_SCHEMA))
    jsonschema.Draft7Validator(schema).validate(isvc)
    assert never_pruned(isvc, schema) == []
    predictor = isvc["spec"]["predictor"]
    assert predictor["model"]["modelFormat"] == {"name": "mlflow"}
    # the artifact location as the registry gives it for that version: nobody typed it
    assert predictor["model"]["storageUri"] == MlflowClient(store["uri"]).get_model_version_download_uri(NAME, store["v2"])
    assert predictor["serviceAccountName"] == "model-server"
    assert predictor.get("canaryTrafficPercent") == (10 if canary else None)
    run = MlflowClient(store["uri"]).get_model_version(NAME, store["v2"]).run_id
    assert {"elastic-step.io/registered-model": "Digits-Classifier", "elastic-step.io/model-version": store["v2"],
            "elastic-step.io/mlflow-run": run}.items() <= isvc["metadata"]["labels"].items()
    assert isvc["metadata"]["annotations"]["elastic-step.io/registered-model-name"] == NAME
    # what a rollback returns to, named where `kubectl get isvc -o yaml` shows it
    assert isvc["metadata"]["annotations"].get("elastic-step.io/previous-version") == (store["v1"] if canary else None)


def test_kserve_schema_catches_what_kserve_would_refuse(store):
    """The schema is no rubber stamp: a wrong type and an unknown field are caught."""
    from elastic_step.release.deploy_render import inference_service
    from elastic_step.release.served_model import resolve

    isvc = inference_service(resolve(NAME, "champion", store["uri"]), settings(), canary=True)
    schema = json.load(open(KSERVE_SCHEMA))
    isvc["spec"]["predictor"]["canaryTrafficPercent"] = "ten"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(isvc)
    isvc["spec"]["predictor"]["canaryTrafficPercent"] = 10
    isvc["spec"]["predictor"]["model"]["storageURI"] = "s3://typo"
    assert never_pruned(isvc, schema) == [".spec.predictor.model.storageURI"]


def test_the_mlflow_target_serves_the_exact_version_ready_on_ping_restricted(store):
    from elastic_step.release.deploy_render import Track, model_deployment, model_service
    from elastic_step.release.served_model import resolve

    model = resolve(NAME, "champion", store["uri"])
    version = kubernetes_validate.utils.latest_version()
    deployments = [model_deployment(model, settings(replicas=3), track, previous_version="1") for track in Track]
    service = model_service(model, settings())
    for obj in [service, *deployments]:
        kubernetes_validate.validate(obj, version, strict=True)
    stable, canary = deployments
    assert [stable["spec"]["replicas"], canary["spec"]["replicas"]] == [3, 1]
    assert stable["metadata"]["name"] == "digits-stable" and canary["metadata"]["name"] == "digits-canary"
    # the Service selects both tracks; each Deployment only its own
    assert set(service["spec"]["selector"].items()) <= set(canary["spec"]["template"]["metadata"]["labels"].items())
    assert stable["spec"]["selector"]["matchLabels"]["elastic-step.io/track"] == "stable"
    pod = stable["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"][container["command"].index("-m", 3) + 1] == f"models:/{NAME}/{store['v2']}"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ping"
    assert container["resources"]["limits"] and container["resources"]["requests"]
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"]}}
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["envFrom"] == [{"secretRef": {"name": "model-store"}}]  # credentials never in the spec
    assert stable["metadata"]["labels"]["elastic-step.io/model-version"] == store["v2"]


def test_deploy_dry_run_prints_the_objects_and_writes_the_outputs(store, tmp_path, capsys):
    from elastic_step.cli import main

    code = main(["deploy", "--registered-model", NAME, "--alias", "champion", "--target", "kserve", "--namespace", "serving",
                 "--service-account", "model-server", "--storage-secret", "model-store", "--dry-run",
                 "--mlflow-uri", store["uri"], "--outputs", str(tmp_path / "out")])
    assert code == 0
    (isvc,) = list(yaml.safe_load_all(capsys.readouterr().out))
    assert isvc["kind"] == "InferenceService" and isvc["metadata"]["name"] == "digits-classifier"
    assert (tmp_path / "out" / "served_version").read_text() == store["v2"]
    assert (tmp_path / "out" / "endpoint").read_text() == "http://digits-classifier.serving.svc.cluster.local"


@pytest.mark.parametrize("args, says", [
    (["--alias", "nope"], f"registered model '{NAME}' has no alias @nope"),
    (["--version", "99"], f"registered model '{NAME}' has no version '99'"),
    (["--alias", "champion", "--target", "seldon"], "--target 'seldon' is not one of kserve, mlflow"),
    (["--alias", "champion", "--canary-percent", "100"], "--canary-percent 100 is not between 1 and 99"),
])
def test_deploy_refuses_bad_input_in_one_line(store, args, says, capsys):
    from elastic_step.cli import main

    code = main(["deploy", "--registered-model", NAME, *args, "--namespace", "serving", "--service-account", "sa",
                 "--storage-secret", "s", "--dry-run", "--mlflow-uri", store["uri"]])
    err = capsys.readouterr().err.strip()
    assert code == 2 and says in err and "\n" not in err, err


def test_deploy_refuses_a_version_without_a_signature(store, capsys):
    from elastic_step.cli import main

    code = main(["deploy", "--registered-model", NAME, "--version", store["unsigned"], "--namespace", "serving",
                 "--service-account", "sa", "--storage-secret", "s", "--dry-run", "--mlflow-uri", store["uri"]])
    err = capsys.readouterr().err.strip()
    assert code == 2 and f"version {store['unsigned']} of '{NAME}' has no signature" in err and "\n" not in err
