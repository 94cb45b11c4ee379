"""Argo step pods for the cluster stand-in: the pod Argo's workflow controller (emissary executor)
makes from one template of a rendered WorkflowTemplate, and the `argoexec` image it needs.
Read from argoproj/argo-workflows v3.6 (workflow/controller/workflowpod.go `createWorkflowPod`,
`addArchiveLocation`, `createSecretVolumesAndMounts`, workflow/util `GeneratePodName`).

The shape is Argo's: an `init` container (argoexec: input artifacts into the `input-artifacts`
volume, the executor into `var-run-argo`), then the `wait` container listed BEFORE `main`, and
`main` — the template's container (its `resources` as written), its command wrapped by
`/var/run/argo/argoexec emissary --`, each input artifact mounted at its path by subPath — with the
template's or else the workflow's `serviceAccountName` and `securityContext` (the pod's). Every
container gets ARGO_TEMPLATE: the template without its input parameters, with its outputs and,
when it has artifacts, its `archiveLocation`: the resolved artifact repository with the key format
(`{{workflow.name}}/{{pod.name}}` by default) resolved; a variable left unresolved there is
refused in Argo's words. The S3 keys the location names (`accessKeySecret`, `secretKeySecret`) are
Secret volumes mounted in `init` and `wait` at /argo/secret/NAME, never env.
With `workflow` (the Workflow object, workflow.py): the pod is owned by it (a controller
ownerReference), named as Argo v2 names a node's pod (`WF-TEMPLATE-fnv32a(node name)`), and the
executor gets ARGO_NODE_ID, ARGO_WORKFLOW_NAME/UID and ARGO_POD_NAME/UID to report its outputs.
Not modelled: podSpecPatch, Argo's other env (ARGO_DEADLINE, progress), sidecars, volumes of the
template, `archiveLogs`, artifact locations other than S3, `activeDeadlineSeconds`.
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


def task_when(spec: dict, template_name: str, workflow_name: str, outputs: dict[str, str]) -> str:
    """The `when` of the DAG task (or step) that runs the template, with the run's parameters and
    earlier tasks' outputs substituted (argowhen.py evaluates it); '' when it has none. A reference
    left unresolved is refused in Argo's words (its node's Error)."""
    for template in spec["templates"]:
        tasks = (template.get("dag") or {}).get("tasks") or [s for group in template.get("steps") or [] for s in group]
        for task in tasks:
            if task.get("template") == template_name and task.get("when"):
                parameters = {p["name"]: str(p.get("value", "")) for p in (spec.get("arguments") or {}).get("parameters") or []}
                known = {"workflow.name": workflow_name, **{f"workflow.parameters.{k}": v for k, v in parameters.items()}, **outputs}
                when = substitute(task["when"], known)
                unresolved = PARAMETER_REFERENCE.search(when)
                if unresolved:
                    raise StepRefused(f"failed to resolve {unresolved.group(0)}")
                return when
    return ""


def fnv32a(text: str) -> int:
    """FNV-1a, 32 bits: how Argo hashes a node's name into its ID and pod name."""
    h = 0x811C9DC5
    for byte in text.encode():
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h


def node_id(workflow_name: str, node_name: str) -> str:
    return f"{workflow_name}-{fnv32a(node_name)}"


def archive_location(repository: dict | None, variables: dict[str, str]) -> dict:
    """ArtifactRepository.ToArtifactLocation with the key format resolved: an S3 repository's
    bucket settings and `key`; {} when no repository is configured (the executor then says so)."""
    if not repository:
        return {}
    if set(repository) - {"s3", "archiveLogs"}:
        raise StepRefused(f"artifact repository {sorted(set(repository) - {'s3', 'archiveLogs'})} is not modelled (S3 only)")
    s3 = dict(repository["s3"])
    key = s3.pop("keyFormat", "") or "/".join(p for p in (s3.pop("keyPrefix", "").strip("/"), "{{workflow.name}}/{{pod.name}}") if p)
    s3.pop("keyPrefix", None)
    location = {"s3": {**s3, "key": substitute(key, variables)}}
    unresolved = re.search(r"\{\{\s*([^}]*?)\s*\}\}", json.dumps(location))
    if unresolved:
        raise StepRefused(f"failed to resolve {{{{{unresolved.group(1)}}}}}")
    return location


def secret_volumes(location: dict) -> tuple[list[dict], list[dict]]:
    """The Secret volumes (and their mounts at /argo/secret/NAME) of an archive location's keys."""
    volumes: dict[str, dict] = {}
    for selector in ((location.get("s3") or {}).get(k) for k in ("accessKeySecret", "secretKeySecret", "sessionTokenSecret")):
        if selector and selector.get("name") and selector.get("key"):
            volume = volumes.setdefault(selector["name"],
                                        {"name": selector["name"], "secret": {"secretName": selector["name"], "items": []}})
            if selector["key"] not in [i["key"] for i in volume["secret"]["items"]]:
                volume["secret"]["items"].append({"key": selector["key"], "path": selector["key"]})
    return list(volumes.values()), [{"name": n, "mountPath": f"/argo/secret/{n}", "readOnly": True} for n in volumes]


def step_pod(template_doc: dict, template_name: str, workflow_name: str, outputs: dict[str, str],
             workflow_parameters: dict[str, str], artifacts: dict[str, dict], *, workflow: dict | None = None,
             node_name: str | None = None, repository: dict | None = None, local: dict[str, str] | None = None,
             executor: dict | None = None) -> dict:
    """The pod of one step, as the controller makes it. Its input parameters are what the DAG's
    task passes it, with the workflow's parameters (`argo submit -p`: `workflow_parameters`, over
    the template's defaults) and earlier tasks' outputs (`outputs`: "tasks.T.outputs.parameters.P"
    -> value) resolved; a declared input left unsupplied, or a reference left unresolved, is
    refused as Argo refuses it. `artifacts`: name -> {"bucket", "key", "endpoint"} of each input
    artifact in the artifact repository. `workflow`: the Workflow object that owns the pod;
    `node_name`: the node it runs (`WF.train(1)`: a retry's second attempt); `repository`: the
    resolved artifact repository (workflow.py `resolve_repository`); `local`: a retry's own
    variables (`retries`, `lastRetry.*`); `executor`: the controller's `executor` setting, whose
    `securityContext` and `resources` Argo gives `init` and `wait` (and nothing else of it here)."""
    spec = template_doc["spec"]
    template = resolved_template(spec, template_name, workflow_name, {**outputs, **(local or {})}, workflow_parameters)
    node_name = node_name or f"{workflow_name}.{template_name}"
    pod_name = f"{workflow_name}-{template_name}-{fnv32a(node_name)}" if workflow else \
        f"{workflow_name}-{template_name}-{abs(hash((workflow_name, template_name))) % 10**10}"
    main, input_artifacts = main_container(template, artifacts)
    executor_template = {"name": template_name, "inputs": {"artifacts": input_artifacts}, "outputs": template.get("outputs") or {}}
    has_artifacts = bool(input_artifacts or executor_template["outputs"].get("artifacts"))
    location = template.get("archiveLocation") or (archive_location(repository, {"workflow.name": workflow_name, "pod.name": pod_name})
                                                   if workflow is not None and has_artifacts else None)
    if location is not None:
        executor_template["archiveLocation"] = location
    executor_env = [{"name": "ARGO_TEMPLATE", "value": json.dumps(executor_template)}]
    if workflow is not None:
        executor_env += [{"name": "ARGO_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                         {"name": "ARGO_POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
                         {"name": "ARGO_WORKFLOW_NAME", "value": workflow_name},
                         {"name": "ARGO_WORKFLOW_UID", "value": workflow["metadata"]["uid"]},
                         {"name": "ARGO_NODE_ID", "value": node_id(workflow_name, node_name)}]
    secrets, secret_mounts = secret_volumes(location or {})
    argo_mounts = [{"name": "var-run-argo", "mountPath": "/var/run/argo"}] + secret_mounts
    pod_spec = {
        "serviceAccountName": template.get("serviceAccountName") or spec.get("serviceAccountName") or "default",
        "restartPolicy": "Never",
        "initContainers": [{"name": "init", "image": ARGOEXEC_IMAGE, "command": ["argoexec", "init", "--loglevel", "info"],
                            "env": executor_env,
                            "volumeMounts": [{"name": "input-artifacts", "mountPath": "/argo/inputs/artifacts"}] + argo_mounts}],
        "containers": [
            {"name": "wait", "image": ARGOEXEC_IMAGE, "command": ["argoexec", "wait", "--loglevel", "info"],
             "env": executor_env, "volumeMounts": argo_mounts},
            main,
        ],
        "volumes": [{"name": "var-run-argo", "emptyDir": {}}, {"name": "input-artifacts", "emptyDir": {}}] + secrets,
    }
    for container in pod_spec["initContainers"] + pod_spec["containers"][:1]:  # init and wait: Argo's own
        container.update({k: executor[k] for k in ("securityContext", "resources") if (executor or {}).get(k)})
    security = template.get("securityContext") or spec.get("securityContext")
    if security:
        pod_spec["securityContext"] = security
    return {"apiVersion": "v1", "kind": "Pod", "metadata": pod_metadata(spec, template, workflow, workflow_name, node_name, pod_name),
            "spec": pod_spec}


def main_container(template: dict, artifacts: dict[str, dict]) -> tuple[dict, list[dict]]:
    """The template's container as `main` (wrapped by the emissary, input artifacts mounted by
    subPath), and the input artifacts as the executor gets them."""
    main = template["container"]
    main["name"] = "main"
    main["command"] = ["/var/run/argo/argoexec", "emissary", "--loglevel", "info", "--"] + list(main.get("command") or [])
    mounts = main.setdefault("volumeMounts", [])
    mounts.append({"name": "var-run-argo", "mountPath": "/var/run/argo"})
    input_artifacts = []
    for artifact in (template.get("inputs") or {}).get("artifacts") or []:
        mounts.append({"name": "input-artifacts", "mountPath": artifact["path"], "subPath": artifact["name"]})
        input_artifacts.append({"name": artifact["name"], "path": artifact["path"], "s3": artifacts[artifact["name"]]})
    return main, input_artifacts


def pod_metadata(spec: dict, template: dict, workflow: dict | None, workflow_name: str, node_name: str, pod_name: str) -> dict:
    metadata = {"name": pod_name, "labels": {"workflows.argoproj.io/workflow": workflow_name, "workflows.argoproj.io/completed": "false",
                                             **(spec.get("podMetadata") or {}).get("labels", {}),
                                             **(template.get("metadata") or {}).get("labels", {})},
                "annotations": {**(spec.get("podMetadata") or {}).get("annotations", {}),
                                **(template.get("metadata") or {}).get("annotations", {}),
                                "workflows.argoproj.io/node-name": node_name}}
    if workflow is not None:
        metadata["annotations"]["workflows.argoproj.io/node-id"] = node_id(workflow_name, node_name)
        metadata["ownerReferences"] = [{"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "name": workflow_name,
                                        "uid": workflow["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]
    return metadata


def resolved_template(spec: dict, template_name: str, workflow_name: str, outputs: dict[str, str],
                      workflow_parameters: dict[str, str]) -> dict:
    """The template with its inputs and the workflow's variables substituted, as executeTemplate
    leaves it for the pod; refused in Argo's words where an input is missing or a reference stays."""
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
    return template
