"""Every MLflow address a shipped file gives as a default (the compiled KFP pipelines, the
examples, the docs, deploy/) is the one deploy/ creates: the Service
`mlflow` of deploy/mlflow in MLflow's own namespace (not the jobs'), from one source in the code
(`elastic_step.defaults.MLFLOW_SERVICE_URI`). A user who applies deploy/ and runs a shipped
pipeline with its defaults reaches that server, not a host nothing creates."""

from __future__ import annotations

import os
import re
import subprocess
from urllib.parse import urlparse

import yaml

from elastic_step import defaults

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPLOY = os.path.join(ROOT, "deploy")
# A cluster address of an MLflow server: `mlflow` or `mlflow.NAMESPACE[.svc[.cluster.local]]`
# with a port, or any `.svc` name (public sites such as mlflow.org carry neither).
CLUSTER_MLFLOW = re.compile(r"https?://(mlflow(?:\.[a-z0-9-]+)*)(:\d+)?")
TEXT = (".py", ".yaml", ".yml", ".md", ".txt", ".json", ".toml", ".cfg", ".sh", "Makefile", "Dockerfile")


def shipped_files() -> list[str]:
    """What a checkout holds (tracked, or new and not ignored), tests left out."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\n")
    return [p for p in listed if p and not p.startswith("tests/") and p.endswith(TEXT)
            and os.path.isfile(os.path.join(ROOT, p))]


def test_the_default_mlflow_uri_is_deploys_service_in_mlflows_own_namespace():
    with open(os.path.join(DEPLOY, "kustomization.yaml"), encoding="utf-8") as f:
        jobs = yaml.safe_load(f)["namespace"]
    with open(os.path.join(DEPLOY, "mlflow", "kustomization.yaml"), encoding="utf-8") as f:
        namespace = yaml.safe_load(f)["namespace"]
    assert (defaults.DEPLOY_NAMESPACE, defaults.MLFLOW_NAMESPACE) == (jobs, namespace) and jobs != namespace
    with open(os.path.join(DEPLOY, "mlflow", "service.yaml"), encoding="utf-8") as f:
        service = next(o for o in yaml.safe_load_all(f) if o)
    uri = urlparse(defaults.MLFLOW_SERVICE_URI)
    assert (uri.scheme, uri.hostname, uri.port) == (
        "http", f"{service['metadata']['name']}.{namespace}.svc.cluster.local", service["spec"]["ports"][0]["port"])
    # The server answers that name: its --allowed-hosts (DNS-rebinding protection) lists it.
    with open(os.path.join(DEPLOY, "mlflow", "deployment.yaml"), encoding="utf-8") as f:
        deployment = next(o for o in yaml.safe_load_all(f) if o and o["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    allowed = next(a for a in args if a.startswith("--allowed-hosts=")).split("=", 1)[1]
    assert uri.netloc in allowed.replace("$(POD_NAMESPACE)", namespace).split(",")


def test_no_shipped_file_names_another_mlflow_host():
    expected = urlparse(defaults.MLFLOW_SERVICE_URI).netloc
    found = []
    for path in shipped_files():
        with open(os.path.join(ROOT, path), encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                for match in CLUSTER_MLFLOW.finditer(line):
                    host, port = match.group(1), match.group(2)
                    if not (port or ".svc" in host):
                        continue  # a public site (mlflow.org), not a server on the cluster
                    if f"{host}{port or ''}" != expected:
                        found.append(f"{path}:{number}: {match.group(0)}")
    assert found == [], f"MLflow hosts other than deploy/'s {expected}: " + "; ".join(found)
    # The docs that make the MLflow Secret the shipped templates read do name it.
    with open(os.path.join(ROOT, "docs", "kubernetes.md"), encoding="utf-8") as f:
        text = f.read()
    assert defaults.MLFLOW_SERVICE_URI in text
    assert f"kubectl create secret generic {defaults.MLFLOW_CREDENTIALS_SECRET} " in text


def test_the_shipped_argo_templates_take_mlflow_from_the_secret_the_docs_make():
    """A user who applies deploy/mlflow and makes `mlflow-credentials` (docs/kubernetes.md) gets a
    working run from the shipped templates: every step takes MLflow's URI, user and password from
    that Secret, the same name and keys as the compiled KFP pipelines, and no workflow parameter
    can point the password at another server."""
    keys = {"MLFLOW_TRACKING_URI": "uri", "MLFLOW_TRACKING_USERNAME": "username", "MLFLOW_TRACKING_PASSWORD": "password"}
    for template in ("training-workflowtemplate.yaml", "retraining-workflowtemplate.yaml"):
        with open(os.path.join(ROOT, "pipelines", "argo", template), encoding="utf-8") as f:
            doc = yaml.safe_load(f)
        assert "mlflow-uri" not in {p["name"] for p in doc["spec"]["arguments"]["parameters"]}, template
        steps = [t for t in doc["spec"]["templates"] if "container" in t]
        assert steps, template
        for step in steps:
            env = {e["name"]: e for e in step["container"]["env"]}
            refs = {name: env[name]["valueFrom"]["secretKeyRef"] for name in keys}
            assert refs == {name: {"name": defaults.MLFLOW_CREDENTIALS_SECRET, "key": key} for name, key in keys.items()}
