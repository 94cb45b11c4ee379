"""Reading a COMPILED KFP pipeline for the cluster stand-in's KFP driver (kfp_driver.py): the
pipeline spec and its Kubernetes platform spec, a task's parameter values as KFP's driver resolves
them (the pipeline's inputs with their defaults, `componentInputParameter`, `runtimeValue`
constants with `{{$.pipeline_job_uuid}}`), and the env an executor's `kfp-kubernetes` config gives
its container (`fieldPathAsEnv` as downward-API env, `secretAsEnv` as `secretKeyRef` env), as
kubeflow/pipelines backend/src/v2/driver makes them."""

from __future__ import annotations

import os

import yaml

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


def platform_env(config: dict) -> list[dict]:
    """The env a `kfp-kubernetes` executor config gives the container."""
    env = [{"name": e["name"], "valueFrom": {"fieldRef": {"fieldPath": e["fieldPath"]}}} for e in config.get("fieldPathAsEnv") or []]
    for secret in config.get("secretAsEnv") or []:
        optional = {"optional": True} if secret.get("optional") else {}
        env += [{"name": k["envVar"], "valueFrom": {"secretKeyRef": {"name": secret["secretName"], "key": k["secretKey"], **optional}}}
                for k in secret["keyToEnv"]]
    return env
