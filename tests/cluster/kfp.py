"""KFP task pods for the cluster stand-in: the pod Kubeflow Pipelines (v2, on Argo) runs one task
of a COMPILED pipeline in, made from the pipeline spec and its Kubernetes platform spec.

What is read from the compiled YAML: the task's executor container (image, command, args) from
`deploymentSpec`; its parameters as KFP's driver resolves them (the pipeline's inputs with their
defaults, `componentInputParameter`, `runtimeValue` constants with `{{$.pipeline_job_uuid}}`); the
output artifacts' types; and the executor's `kfp-kubernetes` config (`fieldPathAsEnv` as
downward-API env, `secretAsEnv` as `secretKeyRef` env, `podMetadata` labels and annotations).

The pod's shape is KFP's on Argo (backend/src/v2/compiler/argocompiler/container.go): Argo's
`init` and `wait` (tests/cluster/argo.py `step_pod`, `wait` before `main`), `main` with the
launcher's env (`KFP_POD_NAME`, `KFP_POD_UID`) and its scratch emptyDirs at /gcs, /s3, /minio,
/.local, /.cache and /.config, where the SDK's artifact paths (`/s3/BUCKET/KEY` for
`s3://BUCKET/KEY`) lie. `main` runs the component's command with the args KFP's launcher hands
it: `{{$}}` replaced by the executor input JSON (inputs' URIs, outputs' URIs and
`outputFile` /tmp/kfp_outputs/output_metadata.json).

Not modelled: the driver and launcher binaries (the `kfp-launcher` init container that copies
`launch`, its download of input artifacts to their local paths and upload of outputs, MLMD and
the cache), the Workflow object, the podSpecPatch merge (the patched container is built here)."""

from __future__ import annotations

import copy
import json
import os

import yaml

from .argo import step_pod

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPILED = os.path.join(REPO, "pipelines", "compiled", "training_pipeline.yaml")
OUTPUT_FILE = "/tmp/kfp_outputs/output_metadata.json"  # the launcher's executorOutput file
SCRATCH = {"gcs-scratch": "/gcs", "s3-scratch": "/s3", "minio-scratch": "/minio", "dot-local-scratch": "/.local",
           "dot-cache-scratch": "/.cache", "dot-config-scratch": "/.config"}


def load_compiled(path: str = COMPILED) -> tuple[dict, dict]:
    """(pipeline spec, Kubernetes platform spec) of a compiled pipeline YAML."""
    with open(path, encoding="utf-8") as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    spec = next(d for d in docs if "deploymentSpec" in d)
    platform = next((d for d in docs if "platforms" in d), {"platforms": {}})
    return spec, (platform["platforms"].get("kubernetes") or {})


def executor_label(spec: dict, task: str) -> str:
    component = spec["root"]["dag"]["tasks"][task]["componentRef"]["name"]
    return spec["components"][component]["executorLabel"]


def task_parameters(spec: dict, task: str, pipeline_parameters: dict, run_id: str) -> dict:
    """The task's parameter values as KFP's driver resolves them."""
    root = {name: d["defaultValue"] for name, d in spec["root"]["inputDefinitions"]["parameters"].items() if "defaultValue" in d}
    root.update(pipeline_parameters)
    component = spec["components"][spec["root"]["dag"]["tasks"][task]["componentRef"]["name"]]
    types = {n: d["parameterType"] for n, d in component["inputDefinitions"]["parameters"].items()}
    values = {}
    for name, source in spec["root"]["dag"]["tasks"][task]["inputs"].get("parameters", {}).items():
        if "componentInputParameter" in source:
            if source["componentInputParameter"] not in root:
                continue
            value = root[source["componentInputParameter"]]
        else:
            value = source["runtimeValue"]["constant"]
            if isinstance(value, str):
                value = value.replace("{{$.pipeline_job_uuid}}", run_id)
        values[name] = int(value) if types.get(name) == "NUMBER_INTEGER" else value
    return values


def executor_input(spec: dict, task: str, parameters: dict, input_artifacts: dict[str, str], output_root: str) -> dict:
    """What the launcher puts in place of `{{$}}`. `input_artifacts`: name -> URI (the producer's
    output in the artifact store); outputs get `OUTPUT_ROOT/NAME` URIs."""
    component = spec["components"][spec["root"]["dag"]["tasks"][task]["componentRef"]["name"]]
    in_defs = component["inputDefinitions"].get("artifacts", {})
    out_defs = (component.get("outputDefinitions") or {}).get("artifacts", {})
    artifact = lambda name, definition, uri: {"artifacts": [{  # noqa: E731
        "name": name, "type": definition["artifactType"], "uri": uri, "metadata": {}}]}
    return {
        "inputs": {"parameterValues": parameters,
                   "artifacts": {n: artifact(n, in_defs[n], uri) for n, uri in input_artifacts.items()}},
        "outputs": {"artifacts": {n: artifact(n, d, f"{output_root}/{n}") for n, d in out_defs.items()},
                    "outputFile": OUTPUT_FILE},
    }


def platform_env(config: dict) -> list[dict]:
    """The env a `kfp-kubernetes` executor config gives the container."""
    env = [{"name": e["name"], "valueFrom": {"fieldRef": {"fieldPath": e["fieldPath"]}}} for e in config.get("fieldPathAsEnv") or []]
    for secret in config.get("secretAsEnv") or []:
        optional = {"optional": True} if secret.get("optional") else {}
        env += [{"name": k["envVar"], "valueFrom": {"secretKeyRef": {"name": secret["secretName"], "key": k["secretKey"], **optional}}}
                for k in secret["keyToEnv"]]
    return env


def task_pod(task: str, run_id: str, pipeline_parameters: dict, input_artifacts: dict[str, str], artifact_root: str,
             service_account: str, env: dict[str, str] | None = None, platform_additions: dict | None = None,
             compiled: str = COMPILED) -> tuple[dict, dict]:
    """The pod of one task of the compiled pipeline, and the executor input its `main` runs with.
    `env`: what `task.set_env_variable` adds to the executor's container; `platform_additions`:
    more `kfp-kubernetes` config for the executor (e.g. `secretAsEnv`, as `use_secret_as_env`
    compiles it); `artifact_root`: the pipeline root (`s3://bucket/v2/artifacts`)."""
    spec, platform = load_compiled(compiled)
    label = executor_label(spec, task)
    container = copy.deepcopy(spec["deploymentSpec"]["executors"][label]["container"])
    config = copy.deepcopy((platform.get("deploymentSpec") or {}).get("executors", {}).get(label) or {})
    for key, value in (platform_additions or {}).items():
        config[key] = list(config.get(key) or []) + list(value) if isinstance(value, list) else value
    parameters = task_parameters(spec, task, pipeline_parameters, run_id)
    pipeline = spec["pipelineInfo"]["name"]
    executor = executor_input(spec, task, parameters, input_artifacts, f"{artifact_root}/{pipeline}/{run_id}/{task}")
    text = json.dumps(executor)
    main = {
        "image": container["image"],
        "command": list(container["command"]),
        "args": [text if a == "{{$}}" else a for a in container.get("args") or []],
        "env": [{"name": "KFP_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "KFP_POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}]
               + [{"name": e["name"], "value": e["value"]} for e in container.get("env") or []]
               + [{"name": k, "value": v} for k, v in (env or {}).items()] + platform_env(config),
        "volumeMounts": [{"name": name, "mountPath": path} for name, path in SCRATCH.items()],
    }
    metadata = config.get("podMetadata") or {}
    template = {"name": "system-container-impl", "container": main,
                "metadata": {"labels": {"pipelines.kubeflow.org/v2_component": "true", **(metadata.get("labels") or {})}}}
    workflow = {"spec": {"serviceAccountName": service_account, "templates": [template]}}
    pod = step_pod(workflow, "system-container-impl", f"{pipeline}-{run_id[:8]}", {}, {}, {})
    pod["metadata"]["annotations"].update(metadata.get("annotations") or {})
    pod["spec"]["volumes"] += [{"name": name, "emptyDir": {}} for name in SCRATCH]
    return pod, executor


def local_path(uri: str) -> str:
    """The path the KFP SDK gives an artifact of this URI in the container (`Artifact.path`)."""
    for prefix, mount in (("s3://", "/s3/"), ("minio://", "/minio/"), ("gs://", "/gcs/")):
        if uri.startswith(prefix):
            return mount + uri[len(prefix):]
    return uri
