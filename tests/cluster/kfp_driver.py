"""KFP v2's driver for one container task of a COMPILED pipeline, for the cluster stand-in, and
the pod it has Argo run the task in (with KFP's launcher, tests/cluster/kfp_launcher.py, inside).
Read from kubeflow/pipelines backend/src/v2 (driver/driver.go `Container`, `resolveInputs`,
`provisionOutputs`, `generateOutputURI`, `initPodSpecPatch`; metadata `GenerateOutputURI`;
config/env.go; compiler/argocompiler/container.go).

The driver, with the run's service account (its pod's token in KFP; here a token of that account):
  - reads ConfigMap `kfp-launcher` (`defaultPipelineRoot`, else `minio://mlpipeline/v2/artifacts`;
    not found is the default, any other refusal fails the run); the run's root is
    ROOT/PIPELINE_NAME/RUN_ID;
  - builds the executor input: parameter values as KFP resolves them (kfp.py `task_parameters`),
    each input artifact a producer task's output (`taskOutputArtifact`: RUN_ROOT/PRODUCER/KEY,
    which MLMD would return), each output artifact at RUN_ROOT/TASK/NAME, each output parameter's
    file /tmp/kfp/outputs/NAME, the executor output file /tmp/kfp_outputs/output_metadata.json;
  - patches the pod (`podSpecPatch`): `main` runs the task's image with the launcher as command
    (`/kfp-launcher/launch --pipeline_name ... --executor_input JSON --component_spec JSON
    --pod_name $(KFP_POD_NAME) --pod_uid $(KFP_POD_UID) --`) and the component's own command and
    args as args (placeholders left for the launcher), the container's env and the `kfp-kubernetes`
    config (kfp.py `platform_env`, pod labels and annotations).
The pod: Argo's `init` and `wait` (argo.py `step_pod`), the init container `kfp-launcher`
(`launcher-v2 --copy /kfp-launcher/launch` into the emptyDir `kfp-launcher`), and KFP's scratch
emptyDirs (/gcs, /s3, /minio, /.local, /.cache, /.config) on `main`.

Not modelled: the root and DAG drivers as pods of their own (this runs in the test with the run's
account), MLMD (an upstream output's URI is computed, not looked up; the launcher does not
pre-publish), the cache (every task runs), `--mlmd_server_address/port` and the metadata
ConfigMap's envFrom, iterators and conditions, PVCs and the other `kfp-kubernetes` settings.
"""

from __future__ import annotations

import copy
import json
import os
import sys

from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from .argo import step_pod
from .kfp import COMPILED, OUTPUT_FILE, SCRATCH, load_compiled, platform_env, task_parameters
from .runtime import Image, python_paths

LAUNCHER_IMAGE = "ghcr.io/kubeflow/kfp-launcher:2.5.0"
LAUNCHER_PATH = "/kfp-launcher/launch"  # component.KFPLauncherPath
DEFAULT_PIPELINE_ROOT = "minio://mlpipeline/v2/artifacts"
HERE = os.path.dirname(os.path.abspath(__file__))


def kfp_launcher_image(folder: str, services: dict[str, str]) -> Image:
    """The launcher's image: `launcher-v2` (tests/cluster/kfp_launcher.py) and the cluster's
    Service table beside it (`NAME.NAMESPACE:PORT` -> `HOST:PORT` of the process behind it)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "launcher-v2")
    with open(os.path.join(HERE, "kfp_launcher.py")) as f:
        body = f.read()
    with open(path, "w") as f:
        f.write(f"#!{sys.executable}\n{body}")
    os.chmod(path, 0o755)
    with open(os.path.join(folder, "services.json"), "w") as f:
        json.dump(services, f)
    return Image(LAUNCHER_IMAGE, {"PATH": "/image/bin:/usr/bin:/bin", "HOME": "/root"}, uid=0, gid=0, workdir="/", home="/root",
                 paths=python_paths(), layers={"/image/bin": folder})


def pipeline_root(api: k8s.CoreV1Api, namespace: str) -> str:
    """config.FromConfigMap + DefaultPipelineRoot, with the run's account (`api`)."""
    try:
        data = api.read_namespaced_config_map("kfp-launcher", namespace).data or {}
    except ApiException as error:
        if error.status != 404:
            raise
        data = {}
    return data.get("defaultPipelineRoot") or DEFAULT_PIPELINE_ROOT


def output_uri(root: str, task: str, name: str) -> str:
    """generateOutputURI: ROOT/TASK/NAME (the root's scheme kept)."""
    return f"{root.rstrip('/')}/{task}/{name}"


class TaskDriver:
    """The driver of one container task of a compiled pipeline run."""

    def __init__(self, task: str, run_id: str, root: str, compiled: str = COMPILED):
        self.spec, self.platform = load_compiled(compiled)
        self.task, self.run_id = task, run_id
        self.pipeline = self.spec["pipelineInfo"]["name"]
        self.run_root = f"{root.rstrip('/')}/{self.pipeline}/{run_id}"
        self.component_name = self.spec["root"]["dag"]["tasks"][task]["componentRef"]["name"]
        self.component = self.spec["components"][self.component_name]

    def upstream_uri(self, producer: str, key: str) -> str:
        """Where an upstream task's output artifact lies (what MLMD would give the driver)."""
        return output_uri(self.run_root, producer, key)

    def executor_input(self, pipeline_parameters: dict) -> dict:
        task = self.spec["root"]["dag"]["tasks"][self.task]
        in_defs = self.component["inputDefinitions"].get("artifacts", {})
        outputs = self.component.get("outputDefinitions") or {}

        def artifact(name: str, definition: dict, uri: str) -> dict:
            return {"artifacts": [{"name": name, "type": definition["artifactType"], "uri": uri, "metadata": {}}]}

        inputs = {}
        for name, source in (task["inputs"].get("artifacts") or {}).items():
            upstream = source["taskOutputArtifact"]
            inputs[name] = artifact(name, in_defs[name], self.upstream_uri(upstream["producerTask"], upstream["outputArtifactKey"]))
        return {
            "inputs": {"parameterValues": task_parameters(self.spec, self.task, pipeline_parameters, self.run_id), "artifacts": inputs},
            "outputs": {"artifacts": {n: artifact(n, d, output_uri(self.run_root, self.task, n))
                                      for n, d in (outputs.get("artifacts") or {}).items()},
                        "parameters": {n: {"outputFile": f"/tmp/kfp/outputs/{n}"} for n in outputs.get("parameters") or {}},
                        "outputFile": OUTPUT_FILE},
        }

    def pod(self, executor_input: dict, service_account: str, env: dict[str, str] | None = None,
            platform_additions: dict | None = None) -> dict:
        """The task's pod. `env`: what `task.set_env_variable` adds to the container;
        `platform_additions`: more `kfp-kubernetes` config for the executor (as `use_secret_as_env`
        compiles it)."""
        label = self.component["executorLabel"]
        container = self.spec["deploymentSpec"]["executors"][label]["container"]
        config = copy.deepcopy((self.platform.get("deploymentSpec") or {}).get("executors", {}).get(label) or {})
        for key, value in (platform_additions or {}).items():
            config[key] = list(config.get(key) or []) + list(value) if isinstance(value, list) else value
        launcher = [LAUNCHER_PATH, "--pipeline_name", self.pipeline, "--run_id", self.run_id, "--execution_id", "1",
                    "--executor_input", json.dumps(executor_input), "--component_spec", json.dumps(self.component),
                    "--pod_name", "$(KFP_POD_NAME)", "--pod_uid", "$(KFP_POD_UID)", "--"]
        main = {
            "image": container["image"], "command": launcher,
            "args": list(container.get("command") or []) + list(container.get("args") or []),
            "env": [{"name": "KFP_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "KFP_POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}]
                   + [{"name": e["name"], "value": e["value"]} for e in container.get("env") or []]
                   + [{"name": k, "value": v} for k, v in (env or {}).items()] + platform_env(config),
            "volumeMounts": [{"name": "kfp-launcher", "mountPath": os.path.dirname(LAUNCHER_PATH)}]
                            + [{"name": name, "mountPath": path} for name, path in SCRATCH.items()],
        }
        metadata = config.get("podMetadata") or {}
        template = {"name": "system-container-impl", "container": main,
                    "metadata": {"labels": {"pipelines.kubeflow.org/v2_component": "true", **(metadata.get("labels") or {})}}}
        workflow = {"spec": {"serviceAccountName": service_account, "templates": [template]}}
        # The run's Workflow is named after the pipeline with a short suffix, as KFP names it.
        pod = step_pod(workflow, "system-container-impl", f"{self.pipeline}-{self.run_id[:5]}", {}, {}, {})
        pod["metadata"]["annotations"].update(metadata.get("annotations") or {})
        pod["spec"]["initContainers"].append({
            "name": "kfp-launcher", "image": LAUNCHER_IMAGE, "command": ["launcher-v2", "--copy", LAUNCHER_PATH],
            "volumeMounts": [{"name": "kfp-launcher", "mountPath": os.path.dirname(LAUNCHER_PATH)}]})
        pod["spec"]["volumes"] += [{"name": "kfp-launcher", "emptyDir": {}}] + [{"name": n, "emptyDir": {}} for n in SCRATCH]
        return pod
