"""Argo step pods for the cluster stand-in: the pod Argo's workflow controller (emissary executor)
makes from one template of a rendered WorkflowTemplate, and the `argoexec` image it needs.

The shape is Argo's: an `init` container (argoexec: input artifacts into the `input-artifacts`
volume, the executor into `var-run-argo`), then the `wait` container listed BEFORE `main`, and
`main` — the template's container, its command wrapped by `/var/run/argo/argoexec emissary --`,
each input artifact mounted at its path by subPath — with the workflow's service account.
Not modelled: the Workflow object (no owner reference to it), output artifacts and parameters,
archives (artifacts are folders), retries, podSpecPatch, Argo's own env (ARGO_*) beyond the template.
"""

from __future__ import annotations

import copy
import json
import os
import re
import sys

from .runtime import Image, python_paths

ARGOEXEC_IMAGE = "quay.io/argoproj/argoexec:v3.6.5"
HERE = os.path.dirname(os.path.abspath(__file__))


def argoexec_image(folder: str) -> Image:
    """The executor image: the argoexec stand-in only (no elastic-step on its PATH)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "argoexec")  # in the image at /image/bin
    with open(os.path.join(HERE, "argoexec.py")) as f:
        body = f.read()
    with open(path, "w") as f:
        f.write(f"#!{sys.executable}\n{body}")
    os.chmod(path, 0o755)
    return Image(ARGOEXEC_IMAGE, {"PATH": "/image/bin:/usr/bin:/bin", "HOME": "/root"}, uid=0, gid=0, workdir="/", home="/root",
                 paths=python_paths(), layers={"/image/bin": folder})


def substitute(value, variables: dict[str, str]):
    if isinstance(value, str):
        return re.sub(r"\{\{\s*([\w.-]+)\s*\}\}", lambda m: variables.get(m.group(1), m.group(0)), value)
    if isinstance(value, list):
        return [substitute(v, variables) for v in value]
    if isinstance(value, dict):
        return {k: substitute(v, variables) for k, v in value.items()}
    return value


class StepRefused(Exception):
    """What Argo's controller says of a step it will not start (its words)."""


PARAMETER_REFERENCE = re.compile(r"\{\{\s*((?:inputs|workflow)\.parameters\.[\w.-]+|tasks\.[\w.-]+)\s*\}\}")


def task_arguments(spec: dict, template_name: str) -> dict[str, str]:
    """The arguments the workflow's DAG (or steps) passes the template's one task, unresolved."""
    for template in spec["templates"]:
        tasks = (template.get("dag") or {}).get("tasks") or [s for group in template.get("steps") or [] for s in group]
        for task in tasks:
            if task.get("template") == template_name:
                return {p["name"]: str(p.get("value", "")) for p in (task.get("arguments") or {}).get("parameters") or []}
    return {}


def step_pod(template_doc: dict, template_name: str, workflow_name: str, outputs: dict[str, str],
             workflow_parameters: dict[str, str], artifacts: dict[str, dict]) -> dict:
    """The pod of one step, as the controller makes it. Its input parameters are what the DAG's
    task passes it, with the workflow's parameters (`argo submit -p`: `workflow_parameters`, over
    the template's defaults) and earlier tasks' outputs (`outputs`: "tasks.T.outputs.parameters.P"
    -> value) resolved; a declared input left unsupplied, or a reference left unresolved, is
    refused as Argo refuses it. `artifacts`: name -> {"bucket", "key", "endpoint"} of each input
    artifact in the artifact repository."""
    spec = template_doc["spec"]
    template = copy.deepcopy(next(t for t in spec["templates"] if t["name"] == template_name))
    parameters = {p["name"]: str(p.get("value", "")) for p in (spec.get("arguments") or {}).get("parameters") or []}
    parameters.update(workflow_parameters)
    known = {"workflow.name": workflow_name, **{f"workflow.parameters.{k}": v for k, v in parameters.items()}, **outputs}
    supplied = substitute(task_arguments(spec, template_name), known)
    inputs = {}
    for declared in (template.get("inputs") or {}).get("parameters") or []:
        name = declared["name"]
        if name in supplied:
            inputs[name] = supplied[name]
        elif "value" in declared or "default" in declared:
            inputs[name] = str(declared.get("value", declared.get("default")))
        else:
            raise StepRefused(f"templates.{template_name}.inputs.parameters.{name} was not supplied")
    template = substitute(template, {**known, **{f"inputs.parameters.{k}": v for k, v in inputs.items()}})
    unresolved = PARAMETER_REFERENCE.search(json.dumps(template))
    if unresolved:
        raise StepRefused(f"templates.{template_name}: failed to resolve {unresolved.group(0)}")
    main = template["container"]
    main["name"] = "main"
    main["command"] = ["/var/run/argo/argoexec", "emissary", "--loglevel", "info", "--"] + list(main.get("command") or [])
    mounts = main.setdefault("volumeMounts", [])
    mounts.append({"name": "var-run-argo", "mountPath": "/var/run/argo"})
    input_artifacts = []
    for artifact in (template.get("inputs") or {}).get("artifacts") or []:
        mounts.append({"name": "input-artifacts", "mountPath": artifact["path"], "subPath": artifact["name"]})
        input_artifacts.append({"name": artifact["name"], "path": artifact["path"], "s3": artifacts[artifact["name"]]})
    executor_env = [{"name": "ARGO_TEMPLATE", "value": json.dumps({"name": template_name, "inputs": {"artifacts": input_artifacts}})}]
    node = f"{workflow_name}-{template_name}-{abs(hash((workflow_name, template_name))) % 10**10}"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": node, "labels": {"workflows.argoproj.io/workflow": workflow_name,
                                              "workflows.argoproj.io/completed": "false",
                                              **(spec.get("podMetadata") or {}).get("labels", {}),
                                              **(template.get("metadata") or {}).get("labels", {})},
                     "annotations": {"workflows.argoproj.io/node-name": f"{workflow_name}.{template_name}"}},
        "spec": {
            "serviceAccountName": template.get("serviceAccountName") or spec.get("serviceAccountName") or "default",
            "restartPolicy": "Never",
            "initContainers": [{"name": "init", "image": ARGOEXEC_IMAGE, "command": ["argoexec", "init", "--loglevel", "info"],
                                "env": executor_env,
                                "volumeMounts": [{"name": "input-artifacts", "mountPath": "/argo/inputs/artifacts"},
                                                 {"name": "var-run-argo", "mountPath": "/var/run/argo"}]}],
            "containers": [
                {"name": "wait", "image": ARGOEXEC_IMAGE, "command": ["argoexec", "wait", "--loglevel", "info"],
                 "env": executor_env, "volumeMounts": [{"name": "var-run-argo", "mountPath": "/var/run/argo"}]},
                main,
            ],
            "volumes": [{"name": "var-run-argo", "emptyDir": {}}, {"name": "input-artifacts", "emptyDir": {}}],
        },
    }

