"""What a container is given from its pod's spec, read through the API with the kubelet's
credentials: volume files (Secret, projected service-account token, CA and namespace, ConfigMap
with `data`, `binaryData`, `items` and `optional`, downward API; emptyDir folders; a hostPath is
the node's folder itself) and env (`envFrom` ConfigMaps and Secrets with `prefix`, values,
`$(VAR)`, `fieldRef`, `secretKeyRef`, `configMapKeyRef`, `resourceFieldRef`). What cannot be
given is a StartError with the kubelet's reason."""

from __future__ import annotations

import base64
import json
import os
import re

from kubernetes import client as k8s

NODE = "node-1"
NODE_IP = "127.0.0.1"


class PodInputs:
    def __init__(self, api: k8s.CoreV1Api, memory_tmpfs: bool):
        self.api = api
        self.memory_tmpfs = memory_tmpfs  # the runtime mounts memory emptyDirs as tmpfs itself

    def make_volume(self, folder: str, pod: dict, volume: dict, fs_group: int | None) -> str:
        """The volume's files in `folder`; \"tmpfs\" for a memory emptyDir the runtime mounts itself."""
        if "emptyDir" in volume:
            if (volume["emptyDir"] or {}).get("medium") == "Memory" and self.memory_tmpfs:
                return "tmpfs"
            os.makedirs(folder)
            os.chmod(folder, 0o777)
            return folder
        if "hostPath" in volume:  # the node's own folder, as it is (the one node: this machine)
            source = volume["hostPath"]
            if source.get("type") == "Directory" and not os.path.isdir(source["path"]):
                raise StartError("CreateContainerConfigError", f"hostPath type check failed: {source['path']} is not a directory")
            return source["path"]
        files: dict[str, tuple[bytes, int]] = {}
        ns = pod["metadata"]["namespace"]
        if "secret" in volume:
            source = volume["secret"]
            mode = source.get("defaultMode", 0o644)
            data = self.secret(ns, source["secretName"], optional=source.get("optional", False))
            for key, value in data.items():
                files[key] = (value, mode)
        elif "configMap" in volume:  # the ConfigMap's keys (data and binaryData, or the listed items) as files
            source = volume["configMap"]
            mode = source.get("defaultMode", 0o644)
            data = self.config_map_files(ns, source["name"], optional=source.get("optional", False))
            for item in source.get("items") or [{"key": k, "path": k} for k in data]:
                if item["key"] not in data:
                    if source.get("optional"):
                        continue
                    raise StartError("CreateContainerConfigError", f'configmap "{source["name"]}" has no key "{item["key"]}"')
                files[item["path"]] = (data[item["key"]], item.get("mode", mode))
        elif "projected" in volume:
            mode = volume["projected"].get("defaultMode", 0o644)
            for source in volume["projected"]["sources"]:
                if "serviceAccountToken" in source:
                    token = self.token(ns, pod["spec"]["serviceAccountName"], pod)
                    files[source["serviceAccountToken"]["path"]] = (token.encode(), mode)
                elif "configMap" in source:
                    data = self.config_map(ns, source["configMap"]["name"])
                    for item in source["configMap"].get("items") or [{"key": k, "path": k} for k in data]:
                        files[item["path"]] = (data[item["key"]].encode(), mode)
                elif "downwardAPI" in source:
                    for item in source["downwardAPI"]["items"]:
                        files[item["path"]] = (field_value(pod, item["fieldRef"]["fieldPath"]).encode(), mode)
                elif "secret" in source:
                    for key, value in self.secret(ns, source["secret"]["name"]).items():
                        files[key] = (value, mode)
        else:
            raise StartError("CreateContainerConfigError", f"volume {volume['name']}: this kubelet cannot mount {sorted(volume)}")
        os.makedirs(folder)
        for name, (data, mode) in files.items():
            path = os.path.join(folder, name)
            with open(path, "wb") as f:
                f.write(data)
            if fs_group is not None:
                os.chown(path, 0, fs_group)
            os.chmod(path, mode)
        return folder

    def secret(self, namespace: str, name: str, optional: bool = False) -> dict[str, bytes]:
        try:
            secret = json.loads(self.api.read_namespaced_secret(name, namespace, _preload_content=False).data)
        except k8s.ApiException as exc:
            if exc.status == 404 and optional:
                return {}
            raise StartError("CreateContainerConfigError", f'secret "{name}" not found') from None
        return {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}

    def config_map(self, namespace: str, name: str, optional: bool = False) -> dict[str, str]:
        return {k: v.decode() for k, v in self.config_map_files(namespace, name, optional, binary=False).items()}

    def config_map_files(self, namespace: str, name: str, optional: bool = False, binary: bool = True) -> dict[str, bytes]:
        """A ConfigMap's `data` (and `binaryData`, base64 in the API) as bytes; {} for a missing optional one."""
        try:
            body = json.loads(self.api.read_namespaced_config_map(name, namespace, _preload_content=False).data)
        except k8s.ApiException as exc:
            if exc.status == 404 and optional:
                return {}
            raise StartError("CreateContainerConfigError", f'configmap "{name}" not found') from None
        files = {k: v.encode() for k, v in (body.get("data") or {}).items()}
        if binary:
            files.update({k: base64.b64decode(v) for k, v in (body.get("binaryData") or {}).items()})
        return files

    def token(self, namespace: str, account: str, pod: dict) -> str:
        """The kubelet's TokenRequest: a token bound to the pod (its name and UID in the user's extra)."""
        bound = k8s.V1BoundObjectReference(api_version="v1", kind="Pod", name=pod["metadata"]["name"],
                                           uid=pod["metadata"].get("uid"))
        request = k8s.AuthenticationV1TokenRequest(spec=k8s.V1TokenRequestSpec(audiences=[], expiration_seconds=3607,
                                                                                bound_object_ref=bound))
        reply = self.api.create_namespaced_service_account_token(account, namespace, request, _preload_content=False)
        return json.loads(reply.data)["status"]["token"]

    def env(self, pod: dict, container: dict) -> dict[str, str]:
        """`envFrom` first (in order, a later source winning), then `env`, which wins over both."""
        env = self.env_from(pod["metadata"]["namespace"], container)
        for var in container.get("env") or []:
            if "valueFrom" not in var:
                env[var["name"]] = expand(var.get("value", ""), env)
                continue
            source = var["valueFrom"]
            if "fieldRef" in source:
                env[var["name"]] = field_value(pod, source["fieldRef"]["fieldPath"])
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                data = self.secret(pod["metadata"]["namespace"], ref["name"], optional=ref.get("optional", False))
                if ref["key"] not in data:
                    if ref.get("optional"):
                        continue
                    raise StartError("CreateContainerConfigError", f'couldn\'t find key {ref["key"]} in Secret {ref["name"]}')
                env[var["name"]] = data[ref["key"]].decode()
            elif "configMapKeyRef" in source:
                ref = source["configMapKeyRef"]
                data = self.config_map(pod["metadata"]["namespace"], ref["name"], optional=ref.get("optional", False))
                if ref["key"] not in data:
                    if ref.get("optional"):
                        continue
                    raise StartError("CreateContainerConfigError", f'couldn\'t find key {ref["key"]} in ConfigMap '
                                                                   f'{pod["metadata"]["namespace"]}/{ref["name"]}')
                env[var["name"]] = data[ref["key"]]
            elif "resourceFieldRef" in source:
                ref = source["resourceFieldRef"]
                kind, _, res = ref["resource"].partition(".")
                env[var["name"]] = str(((container.get("resources") or {}).get(kind) or {}).get(res, "0"))
            else:
                raise StartError("CreateContainerConfigError", f"env {var['name']}: unsupported source {sorted(source)}")
        return env

    def env_from(self, namespace: str, container: dict) -> dict[str, str]:
        """Every key of each `configMapRef`/`secretRef`, with its `prefix`; a key that is not a valid
        variable name is skipped (the kubelet reports it as an event and starts the container)."""
        env = {}
        for source in container.get("envFrom") or []:
            prefix = source.get("prefix", "")
            if "configMapRef" in source:
                ref = source["configMapRef"]
                data = self.config_map(namespace, ref["name"], optional=ref.get("optional", False))
            else:
                ref = source["secretRef"]
                data = {k: v.decode() for k, v in self.secret(namespace, ref["name"], optional=ref.get("optional", False)).items()}
            env.update({prefix + k: v for k, v in data.items() if ENV_NAME.fullmatch(prefix + k)})
        return env


ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")  # what the API server accepts as an env var's name


class StartError(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def expand(value: str, env: dict[str, str]) -> str:
    """$(VAR) references to earlier variables, as Kubernetes expands them."""
    for name, v in env.items():
        value = value.replace(f"$({name})", v)
    return value


def pod_ip(pod: dict) -> str:
    """The pod's own address on the pod network (the kubelet sets it before the containers start), else the node's."""
    return (pod.get("status") or {}).get("podIP") or NODE_IP


def field_value(pod: dict, path: str) -> str:
    """A downward-API fieldPath: metadata.name/namespace/uid, labels['k'], annotations['k'],
    spec.nodeName, spec.serviceAccountName, status.podIP, status.hostIP."""
    meta, spec = pod["metadata"], pod.get("spec", {})
    fixed = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"], "metadata.uid": meta["uid"],
             "spec.nodeName": spec.get("nodeName") or NODE, "spec.serviceAccountName": spec.get("serviceAccountName", ""),
             "status.podIP": pod_ip(pod), "status.hostIP": NODE_IP, "status.podIPs": pod_ip(pod)}
    if path in fixed:
        return fixed[path]
    for prefix, values in (("metadata.labels", meta.get("labels") or {}), ("metadata.annotations", meta.get("annotations") or {})):
        if path.startswith(prefix + "['") and path.endswith("']"):
            return values.get(path[len(prefix) + 2:-2], "")
    raise StartError("CreateContainerConfigError", f"unsupported fieldPath {path}")
