"""Every MLflow address a shipped file gives as a default (the Argo templates' `mlflow-uri`, the
compiled KFP pipelines, the examples, the docs, deploy/) is the one deploy/ creates: the Service
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
    # The shipped defaults do name it.
    for template in ("training-workflowtemplate.yaml", "retraining-workflowtemplate.yaml"):
        with open(os.path.join(ROOT, "pipelines", "argo", template), encoding="utf-8") as f:
            assert defaults.MLFLOW_SERVICE_URI in f.read(), template
