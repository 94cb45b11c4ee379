"""The Argo documents: valid against Argo's own JSON schema, unchanged by a Hera round trip, every
name and reference resolvable, committed copies fresh, and every step's command line accepted by
the real `elastic-step` parser."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml
from hera.workflows import CronWorkflow, Workflow, WorkflowTemplate

from elastic_step import defaults
from elastic_step.argo import RenderOptions
from elastic_step.argo.render import HEADER, render, render_texts
from elastic_step.cli import build_parser, main
from elastic_step.images import default_image

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "tests" / "schemas" / "argo-workflows-v4.1.2.schema.json"  # Argo's own, see tests/schemas/README.md
COMMITTED = ROOT / "pipelines" / "argo"
DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
HERA_CLASSES = {"WorkflowTemplate": WorkflowTemplate, "Workflow": Workflow, "CronWorkflow": CronWorkflow}
VARIANTS = {  # RenderOptions keyword arguments (built per test: the default image reads the environment)
    "artifacts": {},
    "pvc+secret": {"pvc": "training-data", "mlflow_secret": "mlflow:tracking-uri", "cron": "30 2 * * 1-5",
                   "timezone": "Europe/Berlin", "mlflow_credentials": "mlflow-pipelines"},
    "store": {"data_store": "s3://ml-data/elastic-step", "store_secret": "store-credentials",
              "store_endpoint": "http://minio-service.kubeflow:9000"},
}


@pytest.fixture(autouse=True)
def _default_image(monkeypatch):
    monkeypatch.delenv("ELASTIC_STEP_IMAGE", raising=False)


def rendered(variant: str = "artifacts") -> dict[str, str]:
    return render_texts(["training", "retraining"], RenderOptions(**VARIANTS[variant]))


def documents(variant: str = "artifacts") -> dict[str, dict]:
    return {name: yaml.safe_load(text) for name, text in rendered(variant).items()}


ALL = [(variant, name) for variant in VARIANTS for name in documents(variant)]


def templates_of(doc: dict) -> dict[str, dict]:
    return {t["name"]: t for t in doc["spec"]["templates"]}


def dag_of(doc: dict) -> tuple[str, list[dict]]:
    entry = doc["spec"]["entrypoint"]
    return entry, templates_of(doc)[entry]["dag"]["tasks"]


def task(doc: dict, name: str) -> dict:
    return next(t for t in dag_of(doc)[1] if t["name"] == name)


# ---- Argo's JSON schema -------------------------------------------------------------------------

def argo_validator(kind: str | None = None, int_or_string: bool = True):
    """A validator for Argo's schema: the whole of it (one of Argo's kinds) or one kind's definition,
    whose errors point at the offending field."""
    import jsonschema

    schema = json.loads(SCHEMA.read_text())
    if int_or_string:
        # The published schema types IntOrString as string only; Argo and Kubernetes accept both.
        schema["definitions"]["io.k8s.apimachinery.pkg.util.intstr.IntOrString"] = {"type": ["string", "integer"]}
    if kind:
        schema = {"$schema": schema["$schema"], "definitions": schema["definitions"],
                  "$ref": f"#/definitions/io.argoproj.workflow.v1alpha1.{kind}"}
    return jsonschema.Draft202012Validator(schema)


def schema_errors(validator, doc: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}" for e in validator.iter_errors(doc)]


@pytest.mark.parametrize("variant,name", ALL)
def test_every_document_validates_against_argo_schema(variant, name):
    doc = documents(variant)[name]
    assert schema_errors(argo_validator(doc["kind"]), doc) == []
    assert schema_errors(argo_validator(), doc) == []


def test_broken_documents_fail_the_schema():
    validator = argo_validator()
    good = documents()["training-workflowtemplate.yaml"]
    no_spec = {k: v for k, v in good.items() if k != "spec"}
    args_not_a_list = copy.deepcopy(good)
    templates_of(args_not_a_list)["train"]["container"]["args"] = "train --epochs 5"
    wrong_kind = copy.deepcopy(good) | {"kind": "WorkflowTemplates"}
    nameless_task = copy.deepcopy(good)
    del dag_of(nameless_task)[1][0]["name"]
    for broken in (no_spec, args_not_a_list, wrong_kind, nameless_task):
        assert schema_errors(validator, broken), f"schema accepted a broken document: {broken.get('kind')}"


def test_int_or_string_treatment_is_what_lets_integer_retry_limits_pass():
    # retryStrategy.limit: 3 is valid Argo; the unpatched schema rejects it, which is why the
    # validator above widens IntOrString (and why the limit must stay an integer or a string).
    doc = documents()["training-workflowtemplate.yaml"]
    assert templates_of(doc)["train"]["retryStrategy"]["limit"] == 23  # 3 failures + 20 preemptions
    errors = schema_errors(argo_validator("WorkflowTemplate", int_or_string=False), doc)
    assert errors and all("/retryStrategy/" in e for e in errors), errors  # limit and backoff.factor


# ---- Hera round trip, names, references ---------------------------------------------------------

@pytest.mark.parametrize("variant,name", ALL)
def test_hera_round_trip_keeps_every_field(variant, name):
    text = rendered(variant)[name]
    doc = yaml.safe_load(text)
    again = HERA_CLASSES[doc["kind"]].from_yaml(text).to_yaml()
    assert yaml.safe_load(again) == doc
    assert HEADER + again == text


def _check_dns(label: str, value: str, max_len: int = 63):
    assert DNS_1123.match(value) and len(value) <= max_len, f"{label} {value!r} is not a DNS-1123 label"


@pytest.mark.parametrize("variant", VARIANTS)
def test_names_are_dns_1123_and_references_resolve(variant):
    docs = documents(variant)
    template_names = {d["metadata"]["name"] for d in docs.values() if d["kind"] == "WorkflowTemplate"}
    for doc in docs.values():
        meta = doc["metadata"]
        if "name" in meta:
            _check_dns("metadata.name", meta["name"])
        else:  # Argo appends 5 random characters to generateName
            assert meta["generateName"].endswith("-")
            _check_dns("metadata.generateName", meta["generateName"] + "abcde")
        spec = doc["spec"].get("workflowSpec", doc["spec"])
        if "workflowTemplateRef" in spec:
            assert spec["workflowTemplateRef"]["name"] in template_names
        for t in spec.get("templates", []):
            _check_dns("template", t["name"])
        if "templates" in spec:
            for t in dag_of(doc)[1]:
                _check_dns("task", t["name"])
                assert t["template"] in templates_of(doc), f"task {t['name']} names a missing template"
    assert {"elastic-step-training", "elastic-step-retraining"} <= template_names


REF = re.compile(r"\{\{\s*([a-zA-Z0-9_.\-]+)\s*\}\}")


def _refs(node) -> list[str]:
    return REF.findall(json.dumps(node))


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_reference_points_at_a_declared_parameter_or_artifact(variant):
    for doc in documents(variant).values():
        if doc["kind"] != "WorkflowTemplate":
            continue
        spec = doc["spec"]
        workflow_params = {p["name"] for p in spec["arguments"]["parameters"]}
        templates = templates_of(doc)
        entry, tasks = dag_of(doc)
        by_name = {t["name"]: t for t in tasks}
        checked = 0
        for name, t in templates.items():
            inputs = t.get("inputs", {})
            declared = {kind: {p["name"] for p in inputs.get(kind, [])} for kind in ("parameters", "artifacts")}
            body = {k: v for k, v in t.items() if k != "dag"}
            for ref in _refs(body):
                scope, *rest = ref.split(".")
                if scope == "inputs":
                    assert rest[1] in declared[rest[0]], f"{name}: {{{{{ref}}}}} is not declared in inputs"
                    checked += 1
        for t in tasks:
            template = templates[t["template"]]
            wanted = {p["name"] for p in template.get("inputs", {}).get("parameters", [])}
            given = {p["name"] for p in t.get("arguments", {}).get("parameters", [])}
            assert given == wanted, f"task {t['name']}: arguments {sorted(given)} vs inputs {sorted(wanted)}"
            wanted_art = {a["name"] for a in template.get("inputs", {}).get("artifacts", [])}
            given_art = {a["name"] for a in t.get("arguments", {}).get("artifacts", [])}
            assert given_art == wanted_art, f"task {t['name']}: artifacts {sorted(given_art)} vs {sorted(wanted_art)}"
            for ref in _refs(t):
                scope, *rest = ref.split(".")
                if scope == "tasks":
                    source, _, kind, output = rest
                    assert source in by_name, f"{t['name']}: {{{{{ref}}}}} names no task"
                    outputs = templates[by_name[source]["template"]].get("outputs", {}).get(kind, [])
                    assert output in {o["name"] for o in outputs}, f"{t['name']}: {{{{{ref}}}}} is not an output"
                    assert source in _ancestors(t["name"], by_name), f"{t['name']} uses {source} without depending on it"
                    checked += 1
                elif scope == "workflow" and rest[0] == "parameters":
                    assert rest[1] in workflow_params, f"{{{{{ref}}}}} is not a workflow parameter"
        for ref in _refs({k: v for k, v in spec.items() if k != "arguments"}):
            if ref.startswith("workflow.parameters."):
                assert ref.split(".")[2] in workflow_params, f"{{{{{ref}}}}} is not a workflow parameter"
        assert checked > 20  # the check looked at the references, not at nothing


def _ancestors(name: str, by_name: dict) -> set[str]:
    found: set[str] = set()
    todo = [name]
    while todo:
        depends = by_name[todo.pop()].get("depends", "")
        for parent in re.findall(r"[a-z0-9][a-z0-9-]*", depends):  # `a && b.Succeeded` -> a, b
            if parent in by_name and parent not in found:
                found.add(parent)
                todo.append(parent)
    return found


# ---- what the pipelines do ----------------------------------------------------------------------

def test_dag_order_guards_and_retries():
    docs = documents()
    for pipeline in ("training", "retraining"):
        doc = docs[f"{pipeline}-workflowtemplate.yaml"]
        assert task(doc, "train")["depends"] == "prepare-data"
        assert task(doc, "evaluate")["depends"] == "train"
        for guarded in ("export", "promote"):
            assert task(doc, guarded)["when"] == "{{tasks.evaluate.outputs.parameters.blessed}} == true"
        assert task(doc, "promote")["depends"] == "export.Succeeded"
        retry = templates_of(doc)["train"]["retryStrategy"]
        assert retry["limit"] == 23 and retry["backoff"] == {"duration": "30s", "factor": 2, "cap": "10m"}
        assert "retryStrategy" not in templates_of(doc)["evaluate"]
        spec = doc["spec"]
        assert spec["serviceAccountName"] == "elastic-step-runner"
        assert spec["podGC"]["strategy"] and spec["ttlStrategy"]["secondsAfterSuccess"] > 0
        assert templates_of(doc)["train"]["container"]["resources"] == {
            "requests": {"cpu": "4", "memory": "8Gi"}, "limits": {"memory": "8Gi"}}
    train_args = {p: templates_of(docs[f"{p}-workflowtemplate.yaml"])["train"]["container"]["args"]
                  for p in ("training", "retraining")}
    assert "--warm-start-alias" not in train_args["training"]
    retraining = train_args["retraining"]
    assert retraining[retraining.index("--warm-start-alias") + 1] == "champion"
    assert retraining[retraining.index("--registered-model") + 1] == "{{inputs.parameters.registered-model}}"


def test_cron_workflow_schedule_and_policies():
    cron = documents("pvc+secret")["retraining-cronworkflow.yaml"]["spec"]
    assert cron["schedules"] == ["30 2 * * 1-5"] and cron["timezone"] == "Europe/Berlin"
    assert cron["concurrencyPolicy"] == "Forbid"
    assert cron["startingDeadlineSeconds"] == 3600
    assert cron["successfulJobsHistoryLimit"] == 3 and cron["failedJobsHistoryLimit"] == 3
    assert cron["workflowSpec"]["workflowTemplateRef"]["name"] == "elastic-step-retraining"
    assert "training-cronworkflow.yaml" not in documents()


def _env(template: dict) -> dict:
    return {e["name"]: e for e in template["container"]["env"]}


def test_mlflow_uri_from_a_parameter_or_a_secret_and_files_from_artifacts_or_a_pvc():
    plain = documents()["training-workflowtemplate.yaml"]
    secret = documents("pvc+secret")["training-workflowtemplate.yaml"]
    for t in templates_of(plain).values():
        if "container" in t:
            assert _env(t)["MLFLOW_TRACKING_URI"]["value"] == "{{workflow.parameters.mlflow-uri}}"
            assert _env(t)["ARGO_WORKFLOW_NAME"]["value"] == "{{workflow.name}}"
            assert "volumeMounts" not in t["container"]
            assert "MLFLOW_TRACKING_PASSWORD" not in _env(t)
    assert "mlflow-uri" in {p["name"] for p in plain["spec"]["arguments"]["parameters"]}
    assert templates_of(plain)["train"]["inputs"]["artifacts"] == [{"name": "dataset", "path": "/tmp/inputs/dataset"}]
    for t in templates_of(secret).values():
        if "container" in t:
            ref = _env(t)["MLFLOW_TRACKING_URI"]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": "mlflow", "key": "tracking-uri"}
            for name, key in (("MLFLOW_TRACKING_USERNAME", "username"), ("MLFLOW_TRACKING_PASSWORD", "password")):
                assert _env(t)[name] == {"name": name, "valueFrom": {"secretKeyRef": {"name": "mlflow-pipelines", "key": key}}}
            assert t["container"]["volumeMounts"] == [{"name": "work", "mountPath": "/mnt/elastic-step"}]
            assert "artifacts" not in t.get("inputs", {}) and "artifacts" not in t.get("outputs", {})
    assert "mlflow-uri" not in {p["name"] for p in secret["spec"]["arguments"]["parameters"]}
    assert secret["spec"]["volumes"] == [{"name": "work", "persistentVolumeClaim": {"claimName": "training-data"}}]


def test_image_is_the_project_image_unless_overridden(monkeypatch):
    doc = documents()["training-workflowtemplate.yaml"]
    images = {t["container"]["image"] for t in doc["spec"]["templates"] if "container" in t}
    assert images == {default_image()}
    monkeypatch.setenv("ELASTIC_STEP_IMAGE", "registry.example/custom:1")
    other = yaml.safe_load(render_texts(["training"], RenderOptions())["training-workflowtemplate.yaml"])
    assert {t["container"]["image"] for t in other["spec"]["templates"] if "container" in t} == {"registry.example/custom:1"}


def test_with_a_data_store_every_step_and_every_worker_reads_the_dataset_by_its_uri():
    # Worker pods share no file with the train step's pod: the dataset must be where they can
    # read it themselves, not an artifact downloaded into the master's pod.
    doc = documents("store")["training-workflowtemplate.yaml"]
    templates = templates_of(doc)
    uri = "s3://ml-data/elastic-step/{{workflow.name}}/dataset"
    prepare = templates["prepare-data"]["container"]["args"]
    assert prepare[prepare.index("--out") + 1] == uri
    assert [a["name"] for a in templates["prepare-data"]["outputs"]["artifacts"]] == ["summary"]
    for name in ("prepare-data", "train", "evaluate", "export"):
        env = _env(templates[name])
        assert env["AWS_ENDPOINT_URL"]["value"] == "http://minio-service.kubeflow:9000"
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):  # by reference: the workers take the same
            assert env[key] == {"name": key, "valueFrom": {"secretKeyRef": {"name": "store-credentials", "key": key}}}
    for name in ("train", "evaluate", "export"):
        args = templates[name]["container"]["args"]
        assert args[args.index("--data") + 1] == uri
        assert "artifacts" not in templates[name].get("inputs", {})
        assert "artifacts" not in task(doc, name).get("arguments", {})


def test_the_train_step_is_an_elastic_master_that_knows_its_own_pod():
    # The downward API, under the names the Kubernetes backend reads.
    from elastic_step.backends.kubernetes import options

    for pipeline in ("training", "retraining"):
        env = _env(templates_of(documents()[f"{pipeline}-workflowtemplate.yaml"])["train"])
        fields = {name: e["valueFrom"]["fieldRef"]["fieldPath"] for name, e in env.items() if "valueFrom" in e
                  and "fieldRef" in e["valueFrom"]}
        assert fields == {"ELASTIC_STEP_POD_NAME": "metadata.name", "ELASTIC_STEP_POD_UID": "metadata.uid",
                          "ELASTIC_STEP_POD_NAMESPACE": "metadata.namespace", "ELASTIC_STEP_POD_IP": "status.podIP"}
        assert env["ELASTIC_STEP_IMAGE"]["value"] == default_image()  # the workers' image
    source = Path(options.__file__).read_text()
    assert all(f'"{name}"' in source for name in fields)
    labels = documents()["training-workflowtemplate.yaml"]["spec"]["podMetadata"]["labels"]
    assert labels["app.kubernetes.io/part-of"] == "elastic-step"  # deploy/mlflow's NetworkPolicy admits these


POD_FIELDS = ("podSpecPatch", "serviceAccountName", "resources", "securityContext", "nodeSelector", "tolerations",
              "volumes", "hostNetwork", "automountServiceAccountToken")


def _pod_fields(node, path=""):
    """Every value under a field that shapes the pod (not args or env), with its path."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in POD_FIELDS:
                yield f"{path}/{key}", value
            yield from _pod_fields(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _pod_fields(value, f"{path}/{i}")


@pytest.mark.parametrize("variant,name", ALL)
def test_no_run_parameter_reaches_the_pod_spec(variant, name):
    # A parameter pasted into a podSpecPatch can rewrite the pod (privileged, host paths); one in
    # serviceAccountName chooses its API rights. Both are fixed when rendering.
    doc = documents(variant)[name]
    reached = [(where, ref) for where, value in _pod_fields(doc) for ref in _refs(value)]
    assert reached == []
    assert "podSpecPatch" not in json.dumps(doc)


MALICIOUS_CPU = '4"}}}],"securityContext":{"privileged":true},"containers":[{"name":"main","resources":{"requests":{"cpu":"4'


@pytest.mark.parametrize("flag,value", [
    ("--train-cpu", MALICIOUS_CPU),
    ("--train-memory", "8Gi\nsecurityContext: {privileged: true}"),
    ("--step-cpu", "{{workflow.parameters.step-cpu}}"),
    ("--step-memory", "-1Gi"),
    ("--service-account", "{{workflow.parameters.service-account}}"),
])
def test_render_refuses_what_is_not_a_quantity_or_a_name(tmp_path, capsys, flag, value):
    out = tmp_path / "argo"
    assert main(["argo", "render", "--pipeline", "all", "--out", str(out), f"{flag}={value}"]) == 2
    error = capsys.readouterr().err
    assert flag in error and len(error.strip().splitlines()) == 1, error
    assert not out.exists()


def test_render_puts_checked_resources_and_the_service_account_in_the_pod_spec(tmp_path):
    assert main(["argo", "render", "--pipeline", "training", "--out", str(tmp_path), "--train-cpu", "500m",
                 "--train-memory", "3.5Gi", "--train-gpus", "2", "--step-memory", "1Gi",
                 "--service-account", "team-a-runner"]) == 0
    doc = yaml.safe_load((tmp_path / "training-workflowtemplate.yaml").read_text())
    assert doc["spec"]["serviceAccountName"] == "team-a-runner"
    templates = templates_of(doc)
    assert templates["train"]["container"]["resources"] == {
        "requests": {"cpu": "500m", "memory": "3.5Gi", "nvidia.com/gpu": "2"},
        "limits": {"memory": "3.5Gi", "nvidia.com/gpu": "2"}}
    assert templates["evaluate"]["container"]["resources"]["limits"] == {"memory": "1Gi"}


@pytest.mark.parametrize("flags,expected", [
    (["--worker-cpu", "500m:2", "--worker-memory", "4Gi", "--ps-cpu", "1", "--ps-memory", "6Gi:8Gi"],
     {"--worker-cpu": "500m:2", "--worker-memory": "4Gi", "--ps-cpu": "1", "--ps-memory": "6Gi:8Gi"}),
    (["--worker-memory", "1.5Gi"], {"--worker-memory": "1.5Gi"}),
    ([], {}),
])
def test_render_fixes_the_worker_pods_resources_in_the_train_step(tmp_path, flags, expected):
    assert main(["argo", "render", "--pipeline", "all", "--out", str(tmp_path)] + flags) == 0
    for pipeline in ("training", "retraining"):
        doc = yaml.safe_load((tmp_path / f"{pipeline}-workflowtemplate.yaml").read_text())
        args = templates_of(doc)["train"]["container"]["args"]
        found = {flag: args[args.index(flag) + 1] for flag in ("--worker-cpu", "--worker-memory", "--ps-cpu", "--ps-memory")
                 if flag in args}
        assert found == expected
        workflow_params = {p["name"]: p["value"] for p in doc["spec"]["arguments"]["parameters"]}
        task_args = {p["name"]: p["value"] for p in task(doc, "train")["arguments"]["parameters"]}
        parsed = build_parser().parse_args([_resolve(a, task_args, workflow_params) for a in args])
        assert (parsed.worker_cpu, parsed.worker_memory, parsed.ps_cpu, parsed.ps_memory) == tuple(
            expected.get(flag) for flag in ("--worker-cpu", "--worker-memory", "--ps-cpu", "--ps-memory"))


@pytest.mark.parametrize("flag,value", [
    ("--worker-cpu", MALICIOUS_CPU),
    ("--worker-cpu", "{{workflow.parameters.worker-cpu}}"),
    ("--worker-cpu", "2:500m"),
    ("--worker-cpu", "0"),
    ("--worker-memory", "4Gi:"),
    ("--worker-memory", "lots"),
    ("--worker-memory", "4Gi --image evil"),
    ("--ps-cpu", "{{workflow.parameters.ps-cpu}}"),
    ("--ps-memory", "8Gi:4Gi"),
])
def test_render_refuses_worker_resources_that_are_not_quantities(tmp_path, capsys, flag, value):
    out = tmp_path / "argo"
    assert main(["argo", "render", "--pipeline", "all", "--out", str(out), f"{flag}={value}"]) == 2
    error = capsys.readouterr().err
    assert flag in error and len(error.strip().splitlines()) == 1, error
    assert not out.exists()


def test_evaluate_and_export_load_the_weights_into_the_workflows_model_definition():
    # The gate and export take the network from the workflow's model-def parameter, the one the
    # train step trained; never from the training run's own model_def parameter in MLflow.
    for variant in VARIANTS:
        for pipeline in ("training", "retraining"):
            doc = documents(variant)[f"{pipeline}-workflowtemplate.yaml"]
            templates = templates_of(doc)
            for name in ("train", "evaluate", "export"):
                args = templates[name]["container"]["args"]
                assert args[args.index("--model-def") + 1] == "{{inputs.parameters.model-def}}", (variant, name)
                given = {p["name"]: p["value"] for p in task(doc, name)["arguments"]["parameters"]}
                assert given["model-def"] == "{{workflow.parameters.model-def}}", (variant, name)


# ---- the argo-workflows package's typed models (no ../shared needed) ---------------------------

def typed(doc: dict):
    """The document loaded into the argo-workflows package's models, as its API client does with
    a server's answer: every field typed, required fields present. IntOrString fields (retry
    limit, backoff factor) are typed str there; Argo accepts integers, so they are given as text."""
    from argo_workflows.api_client import ApiClient
    from argo_workflows.model.io_argoproj_workflow_v1alpha1_cron_workflow import IoArgoprojWorkflowV1alpha1CronWorkflow
    from argo_workflows.model.io_argoproj_workflow_v1alpha1_workflow import IoArgoprojWorkflowV1alpha1Workflow
    from argo_workflows.model.io_argoproj_workflow_v1alpha1_workflow_template import (
        IoArgoprojWorkflowV1alpha1WorkflowTemplate,
    )

    models = {"Workflow": IoArgoprojWorkflowV1alpha1Workflow, "WorkflowTemplate": IoArgoprojWorkflowV1alpha1WorkflowTemplate,
              "CronWorkflow": IoArgoprojWorkflowV1alpha1CronWorkflow}
    doc = copy.deepcopy(doc)
    spec = doc["spec"].get("workflowSpec", doc["spec"])
    for template in spec.get("templates", []):
        retry = template.get("retryStrategy")
        if retry:
            retry["limit"] = str(retry["limit"])
            if "backoff" in retry and "factor" in retry["backoff"]:
                retry["backoff"]["factor"] = str(retry["backoff"]["factor"])

    class Response:
        data = json.dumps(doc)

    client = ApiClient()
    return client, client.deserialize(Response(), (models[doc["kind"]],), True), doc


def unknown_fields(obj, path="") -> list[str]:
    """Keys the models do not know (the package keeps them instead of refusing them)."""
    from argo_workflows.model_utils import OpenApiModel

    found = []
    if isinstance(obj, OpenApiModel):
        known = type(obj).attribute_map
        for key, value in obj._data_store.items():
            if key not in known:
                found.append(f"{path}/{key}")
            found += unknown_fields(value, f"{path}/{known.get(key, key)}")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            found += unknown_fields(value, f"{path}/{i}")
    elif isinstance(obj, dict):
        for key, value in obj.items():
            found += unknown_fields(value, f"{path}/{key}")
    return found


@pytest.mark.parametrize("variant,name", ALL)
def test_every_document_loads_into_argo_workflows_typed_models(variant, name):
    client, model, given = typed(documents(variant)[name])
    assert unknown_fields(model) == []
    assert client.sanitize_for_serialization(model) == given  # nothing lost or changed on the way


def test_typed_models_catch_what_yaml_syntax_does_not():
    import argo_workflows

    good = documents()["training-workflowtemplate.yaml"]
    args_not_a_list = copy.deepcopy(good)
    templates_of(args_not_a_list)["train"]["container"]["args"] = "train --epochs 5"
    no_image = copy.deepcopy(good)
    del templates_of(no_image)["train"]["container"]["image"]
    for broken in (args_not_a_list, no_image):
        with pytest.raises((argo_workflows.ApiTypeError, argo_workflows.ApiValueError, TypeError)):
            typed(broken)
    misspelt = copy.deepcopy(good)
    templates_of(misspelt)["train"]["container"]["argz"] = ["train"]
    assert unknown_fields(typed(misspelt)[1]) == ["/spec/templates/1/container/argz"]


# ---- the committed YAML -------------------------------------------------------------------------

def test_committed_argo_yaml_is_fresh(tmp_path):
    # As `make compile` renders them: MLflow's URI and user from the Secret the KFP pipelines take too.
    render(["training", "retraining"], tmp_path, RenderOptions(mlflow_credentials=defaults.MLFLOW_CREDENTIALS_SECRET))
    fresh = {p.name: p.read_text() for p in tmp_path.glob("*.yaml")}
    committed = {p.name: p.read_text() for p in COMMITTED.glob("*.yaml")}
    assert sorted(committed) == sorted(fresh), "pipelines/argo/ has other files than `make compile` writes"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale: {stale}; run `make compile` and commit pipelines/argo/"


# ---- each step's command line against the real CLI ----------------------------------------------

WORKFLOW_NAME = "elastic-step-training-abcde"
SAMPLE_OUTPUTS = {"run_id": "0123456789abcdef", "model_uri": "models:/m-0123", "blessed": "true",
                  "model_version": "7", "champion_version": "7"}


def _resolve(text: str, task_args: dict, workflow_params: dict) -> str:
    def one(match):
        scope, *rest = match.group(1).split(".")
        if scope == "inputs":
            return _resolve(task_args[rest[1]], task_args, workflow_params)
        if scope == "workflow":
            return workflow_params[rest[1]] if rest[0] == "parameters" else WORKFLOW_NAME
        if scope == "tasks":
            return SAMPLE_OUTPUTS[rest[-1]]
        raise AssertionError(f"unexpected reference {match.group(0)}")
    return REF.sub(one, text)


STEP_COMMANDS = {"prepare-data": "prepare-data", "train": "train", "evaluate": "evaluate", "export": "export",
                 "promote": "promote", "deploy": "deploy"}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("pipeline", ["training", "retraining"])
def test_every_step_command_line_parses_with_the_real_cli(variant, pipeline):
    doc = documents(variant)[f"{pipeline}-workflowtemplate.yaml"]
    workflow_params = {p["name"]: p["value"] for p in doc["spec"]["arguments"]["parameters"]}
    templates = templates_of(doc)
    parser = build_parser()
    for t in dag_of(doc)[1]:
        template = templates[t["template"]]
        assert template["container"]["command"] == ["elastic-step"]
        task_args = {p["name"]: p["value"] for p in t["arguments"]["parameters"]}
        argv = [_resolve(a, task_args, workflow_params) for a in template["container"]["args"]]
        try:
            args = parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"`elastic-step {' '.join(argv)}` is rejected by the CLI parser")
        assert args.command == STEP_COMMANDS[t["name"]]
        # the files the template declares are the ones the command writes under --outputs
        outputs = template.get("outputs", {})
        for p in outputs.get("parameters", []):
            assert _resolve(p["valueFrom"]["path"], task_args, workflow_params) == f"{args.outputs}/{p['name']}"
        for a in outputs.get("artifacts", []):
            assert _resolve(a["path"], task_args, workflow_params).startswith(f"{args.outputs}/")
        for a in template.get("inputs", {}).get("artifacts", []):
            assert a["path"] == args.data  # the dataset arrives where --data reads it
        if t["name"] == "prepare-data":
            assert args.out == (f"s3://ml-data/elastic-step/{WORKFLOW_NAME}/dataset" if variant == "store"
                                else f"{args.outputs}/dataset")
        if t["name"] in ("train", "evaluate", "export") and variant != "artifacts":
            assert args.data == _resolve(templates["train"]["container"]["args"][4], task_args, workflow_params)


@pytest.mark.parametrize("pipeline", ["training", "retraining"])
def test_a_ps_runs_parameters_reach_its_steps(pipeline):
    """`argo submit -p mode=ps -p ps-shards=3 -p ps-table-limit-mb=64 -p categorical=auto`:
    prepare-data turns the string columns into ids (its --categorical, as the KFP pipelines'
    `categorical` goes to prepare_data) and the train step trains in PS mode on 3 shards (on the
    local backend, in its own pod), serving tables past 64 MB from the shards' snapshots; left
    unset, prepare-data turns no column into ids and train trains allreduce, as the CLI's defaults do."""
    from elastic_step.data.categorical_spec import parse_categorical

    doc = documents()[f"{pipeline}-workflowtemplate.yaml"]
    defaults_ = {p["name"]: p["value"] for p in doc["spec"]["arguments"]["parameters"]}
    assert defaults_["categorical"] == ""

    def parsed(step: str, run: dict):
        task_args = {p["name"]: p["value"] for p in task(doc, step)["arguments"]["parameters"]}
        argv = templates_of(doc)[step]["container"]["args"]
        return build_parser().parse_args([_resolve(a, task_args, defaults_ | run) for a in argv])

    ps_run = {"mode": "ps", "ps-shards": "3", "ps-table-limit-mb": "64"}
    for run, expected in (({}, ("allreduce", 2, 2048)), (ps_run, ("ps", 3, 64))):
        args = parsed("train", run)
        assert (args.mode, args.ps_shards, args.ps_table_limit_mb, args.backend) == (*expected, "local")
    assert parse_categorical(parsed("prepare-data", {}).categorical) == ({}, False)
    assert parse_categorical(parsed("prepare-data", {"categorical": "auto"}).categorical) == ({}, True)
    specs, auto = parse_categorical(parsed("prepare-data", {"categorical": "C1=hash:100;C2"}).categorical)
    assert (sorted(specs), auto) == (["C1", "C2"], False)


# ---- the CLI ------------------------------------------------------------------------------------

def test_render_cli_writes_the_files(tmp_path, capsys):
    assert main(["argo", "render", "--pipeline", "retraining", "--out", str(tmp_path / "argo"),
                 "--pvc", "shared-data", "--cron", "15 4 * * *", "--timezone", "Asia/Tokyo"]) == 0
    names = sorted(p.name for p in (tmp_path / "argo").iterdir())
    assert names == ["retraining-cronworkflow.yaml", "retraining-workflow.yaml", "retraining-workflowtemplate.yaml"]
    cron = yaml.safe_load((tmp_path / "argo" / "retraining-cronworkflow.yaml").read_text())
    assert cron["spec"]["schedules"] == ["15 4 * * *"] and cron["spec"]["timezone"] == "Asia/Tokyo"
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize("flags,message", [
    (["--pvc", "Not_A_Name"], "--pvc"),
    (["--cron", "0 0 3 * * *"], "drop the seconds"),
    (["--cron", "0 25 * * *"], "hour 25"),
    (["--timezone", "Mars/Olympus"], "--timezone"),
    (["--mlflow-secret", "MLflow"], "--mlflow-secret"),
    (["--train-retries", "-1"], "--train-retries"),
    (["--mlflow-secret", "MLflow Users"], "--mlflow-secret"),
    (["--mlflow-secret", "MLflow:tracking-uri"], "--mlflow-secret"),
    (["--data-store", "/mnt/data"], "--data-store"),
    (["--data-store", "s3://b/{{workflow.parameters.x}}"], "--data-store"),
    (["--data-store", "s3://b/p", "--pvc", "shared"], "choose one"),
    (["--store-endpoint", "minio:9000"], "--store-endpoint"),
    (["--store-secret", "Store_Creds"], "--store-secret"),
])
def test_render_cli_bad_input_is_a_clear_error_and_writes_nothing(tmp_path, capsys, flags, message):
    out = tmp_path / "argo"
    assert main(["argo", "render", "--pipeline", "all", "--out", str(out)] + flags) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_old_secret_flags_render_as_before_and_say_the_new_name(tmp_path, capsys):
    """Scripts written for the old flags keep working: `--mlflow-credentials NAME` renders what
    `--mlflow-secret NAME` does, and `--mlflow-secret NAME:KEY` still takes the URI alone from
    KEY; each says, in one line, what to write instead."""
    def rendered(*flags: str) -> tuple[str, str]:
        out = tmp_path / "-".join(flags)
        assert main(["argo", "render", "--pipeline", "training", "--out", str(out), *flags]) == 0
        return (out / "training-workflowtemplate.yaml").read_text(), capsys.readouterr().err

    new, quiet = rendered("--mlflow-secret", "mlflow-credentials")
    assert quiet == "" and "name: mlflow-credentials" in new and "MLFLOW_TRACKING_PASSWORD" in new
    old, said = rendered("--mlflow-credentials", "mlflow-credentials")
    assert old == new and said.count("\n") == 1 and "--mlflow-credentials is deprecated, use --mlflow-secret" in said
    uri_only, said = rendered("--mlflow-secret", "mlflow:tracking-uri")
    assert "key: tracking-uri" in uri_only and "MLFLOW_TRACKING_PASSWORD" not in uri_only
    assert said.count("\n") == 1 and "deprecated" in said


def test_render_cli_refuses_a_file_as_out(tmp_path, capsys):
    target = tmp_path / "file.yaml"
    target.write_text("keep me")
    assert main(["argo", "render", "--pipeline", "training", "--out", str(target)]) == 2
    assert "is a file" in capsys.readouterr().err and target.read_text() == "keep me"


# ---- parity with the KFP pipelines --------------------------------------------------------------

COMPILED = ROOT / "pipelines" / "compiled"  # the KFP pipelines as `make compile` wrote them (a test keeps them fresh)
# The Argo step that runs the same `elastic-step` command as each KFP component.
STEP_OF_COMPONENT = {"prepare-data": "prepare-data", "train-elastic": "train", "evaluate-model": "evaluate",
                     "export-model": "export", "promote-model": "promote", "deploy-model": "deploy"}
# Names that differ: the CLI's repeatable METRIC=VALUE flags are singular (`--floor accuracy=0.9`), the KFP
# inputs are dicts named in the plural. Every other name is the KFP one with '-' for '_'.
RENAMED = {"floors": "floor", "min_gains": "min-gain"}
# KFP pipeline parameters that have no Argo counterpart, on purpose.
KFP_ONLY = {
    # Argo steps take MLflow's URI as MLFLOW_TRACKING_URI from the mlflow-credentials Secret, never from a
    # step flag, so whoever submits a run cannot send the steps (and the password) to another server; a
    # render without MLflow credentials has an `mlflow-uri` parameter, which reaches that variable only.
    "mlflow_uri",
    # The job's folder is where the template's storage layout puts it (the pod's /tmp/job, or the
    # workflow's folder on the PVC), fixed when rendering: not a path inside the pod that a run chooses.
    "job_dir",
}
# Argo workflow parameters the KFP pipelines do not expose, on purpose: none (each would need its reason here).
ARGO_ONLY: set[str] = set()


def argo_name(kfp_name: str) -> str:
    return RENAMED.get(kfp_name, kfp_name.replace("_", "-"))


def kfp_parameter_routes(pipeline: str) -> tuple[dict, dict[str, set[tuple[str, str]]], dict[tuple[str, str], str]]:
    """From the compiled KFP pipeline: its parameters' definitions (type, default), the (component, input)
    pairs each one reaches through every sub-pipeline and condition, and the constants its tasks are given."""
    spec = next(yaml.safe_load_all((COMPILED / f"{pipeline}_pipeline.yaml").read_text()))
    definitions = spec["root"]["inputDefinitions"]["parameters"]
    routes: dict[str, set[tuple[str, str]]] = {name: set() for name in definitions}
    constants: dict[tuple[str, str], str] = {}

    def walk(dag_component: dict, origin: dict[str, str]) -> None:  # origin: this DAG's input → pipeline parameter
        for dag_task in dag_component["dag"]["tasks"].values():
            ref = dag_task["componentRef"]["name"]
            inner = {}
            for name, source in dag_task["inputs"].get("parameters", {}).items():
                if source.get("componentInputParameter") in origin:
                    inner[name] = origin[source["componentInputParameter"]]
                elif "runtimeValue" in source:
                    constants[(ref.removeprefix("comp-"), name)] = source["runtimeValue"]["constant"]
            if "dag" in spec["components"][ref]:
                walk(spec["components"][ref], inner)
            else:
                for name, parameter in inner.items():
                    routes[parameter].add((ref.removeprefix("comp-"), name))

    walk(spec["root"], {name: name for name in definitions})
    return definitions, routes, constants


def same_as_kfp_default(definition: dict, parsed) -> bool:
    """The KFP default, and what the step's CLI parsed from the Argo default, mean the same value."""
    default = definition.get("defaultValue")
    if isinstance(parsed, list) and definition["parameterType"] != "STRUCT":  # a repeatable flag, given once
        assert len(parsed) == 1, parsed
        parsed = parsed[0]
    if definition["parameterType"] == "STRUCT":  # floors / min_gains: a dict in KFP, METRIC=VALUE for the CLI
        from elastic_step.release.thresholds import parse_pairs

        return parse_pairs(default, "kfp") == parse_pairs(parsed, "argo")
    if definition["parameterType"] == "NUMBER_INTEGER":  # KFP's IR writes integers as floats (512.0)
        return parsed == int(default)
    return parsed == default


def _step_argv(doc: dict, step: str, workflow_params: dict) -> list[str]:
    task_args = {p["name"]: p["value"] for p in task(doc, step)["arguments"]["parameters"]}
    return [_resolve(a, task_args, workflow_params) for a in templates_of(doc)[step]["container"]["args"]]


@pytest.mark.parametrize("pipeline", ["training", "retraining"])
def test_every_kfp_pipeline_parameter_that_reaches_a_step_has_an_argo_parameter(pipeline):
    """Parity with the KFP pipeline of the same name, read from its compiled IR (not from a list kept
    here): every pipeline parameter that reaches a component's input is a workflow parameter of the same
    name (RENAMED aside) and default, and reaches the Argo step that runs that component's command on the
    flag of the input's name; KFP_ONLY says which do not, and why. The other way round, every workflow
    parameter is a KFP pipeline parameter's, or in ARGO_ONLY."""
    definitions, routes, constants = kfp_parameter_routes(pipeline)
    assert {"split", "rows_per_shard", "seed", "epochs", "floors", "serve_target"} <= set(routes)  # read, not empty
    doc = documents()[f"{pipeline}-workflowtemplate.yaml"]
    argo_defaults = {p["name"]: p["value"] for p in doc["spec"]["arguments"]["parameters"]}
    parser = build_parser()
    missing = sorted(name for name, reached in routes.items()
                     if reached and name not in KFP_ONLY and argo_name(name) not in argo_defaults)
    assert not missing, f"KFP pipeline parameters with no Argo workflow parameter: {missing} (add them to " \
                        "elastic_step/argo/, or to KFP_ONLY with the reason)"
    warm_start_alias = constants[("train-elastic", "warm_start_alias")]
    checked = 0
    for kfp_name, reached in sorted(routes.items()):
        if kfp_name in KFP_ONLY:
            continue
        for component, input_name in sorted(reached):
            step = STEP_OF_COMPONENT[component]
            if (component, input_name) == ("train-elastic", "registered_model") and not warm_start_alias:
                # train reads the registered model only to warm-start from its alias, which this pipeline leaves empty
                assert "--registered-model" not in _step_argv(doc, step, argo_defaults)
                continue
            flag = f"--{argo_name(input_name)}"
            probe = f"probe-{kfp_name}"
            argv = _step_argv(doc, step, argo_defaults | {argo_name(kfp_name): probe})
            assert [flag, probe] in [argv[i:i + 2] for i in range(len(argv) - 1)], \
                f"{step}: `-p {argo_name(kfp_name)}=...` does not reach {flag} as KFP's {kfp_name} reaches {component}"
            parsed = getattr(parser.parse_args(_step_argv(doc, step, argo_defaults)), flag[2:].replace("-", "_"))
            assert same_as_kfp_default(definitions[kfp_name], parsed), \
                f"{argo_name(kfp_name)}: Argo's default gives {step} {flag} {parsed!r}, KFP's is " \
                f"{definitions[kfp_name].get('defaultValue')!r}"
            checked += 1
    assert checked >= 30
    # The constant that decides what train does with registered-model is the same on both.
    train_argv = _step_argv(doc, "train", argo_defaults)
    assert (train_argv[train_argv.index("--warm-start-alias") + 1] if "--warm-start-alias" in train_argv else "") \
        == warm_start_alias
    argo_only = set(argo_defaults) - {argo_name(name) for name in routes}
    assert argo_only <= ARGO_ONLY, f"workflow parameters the KFP pipeline lacks: {sorted(argo_only - ARGO_ONLY)}"


def test_a_kfp_parameter_with_no_argo_counterpart_fails_the_parity_check(monkeypatch):
    """The parity test sees a parameter missing from the templates: without `rows-per-shard` it fails."""
    from elastic_step.argo import documents as argo_documents

    monkeypatch.delitem(argo_documents.PARAMETERS, "rows-per-shard")
    with pytest.raises(AssertionError, match=r"no Argo workflow parameter: \['rows_per_shard'\]"):
        test_every_kfp_pipeline_parameter_that_reaches_a_step_has_an_argo_parameter("training")


@pytest.mark.parametrize("dropped", ["label", "device", "precision"])
def test_an_argo_parameter_the_kfp_pipeline_drops_fails_the_parity_check(monkeypatch, dropped):
    """The other way round: a pipeline whose compiled IR lacks `label`, `device` or `precision` (once
    Argo-only) fails the parity test."""
    routes_of = kfp_parameter_routes

    def without(pipeline):
        definitions, routes, constants = routes_of(pipeline)
        assert routes.pop(dropped), f"the compiled {pipeline} pipeline's {dropped} reaches no component"
        return {k: v for k, v in definitions.items() if k != dropped}, routes, constants

    monkeypatch.setitem(globals(), "kfp_parameter_routes", without)
    with pytest.raises(AssertionError, match=rf"workflow parameters the KFP pipeline lacks: \['{dropped}'\]"):
        test_every_kfp_pipeline_parameter_that_reaches_a_step_has_an_argo_parameter("training")


def test_a_runs_split_and_rows_per_shard_shape_the_prepared_data(tmp_path):
    """`argo submit -p split=0.5,0.25,0.25 -p rows-per-shard=5`: prepare-data's command line, as the
    template builds it, writes half the rows to train and a quarter to each of val and test, in shards of
    5 rows (left unset: 0.8,0.1,0.1 and 512, the KFP pipelines' defaults)."""
    doc = documents()["training-workflowtemplate.yaml"]
    argo_defaults = {p["name"]: p["value"] for p in doc["spec"]["arguments"]["parameters"]}
    assert (argo_defaults["split"], argo_defaults["rows-per-shard"]) == (defaults.SPLIT, str(defaults.ROWS_PER_SHARD))
    source = tmp_path / "rows.csv"  # 40 rows: a CSV rather than sklearn:digits keeps this test to a second
    source.write_text("x,label\n" + "".join(f"{i},{i % 2}\n" for i in range(40)))
    run = {"source": str(source), "split": "0.5,0.25,0.25", "rows-per-shard": "5"}
    argv = _step_argv(doc, "prepare-data", argo_defaults | run)
    argv[argv.index("--out") + 1] = str(tmp_path / "dataset")
    argv[argv.index("--outputs") + 1] = str(tmp_path / "outputs")
    assert main(argv) == 0
    manifest = json.loads((tmp_path / "dataset" / "manifest.json").read_text())
    rows = {split: [shard["rows"] for shard in shards] for split, shards in manifest["splits"].items()}
    assert rows == {"train": [5] * 4, "val": [5] * 2, "test": [5] * 2}, rows
