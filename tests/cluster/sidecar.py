"""Istio's sidecar injection, as a Kubeflow profile namespace has it, for the cluster stand-in.

Kubeflow's profile controller labels every profile namespace `istio-injection=enabled`, and
kubeflow/manifests (common/istio) installs a mesh-wide PeerAuthentication in STRICT mode. Istio's
injector (a mutating webhook: it runs before the validating admission of admission.py) then adds
the Envoy proxy to every pod of such a namespace, unless the pod opts out with the label (or the
older annotation) `sidecar.istio.io/inject: "false"`. Since Istio 1.27 the proxy is a native
sidecar (an init container with `restartPolicy: Always`, Kubernetes >= 1.29): the kubelet starts
it before the pod's containers and stops it once they have all ended, so a pod that runs to
completion ends. The annotation `sidecar.istio.io/nativeSidecar: "false"` asks for the classic
container instead, which never ends on its own (the Istio + Job problem).

    injector = IstioInjector()
    cluster.server.mutators.append(injector.inject)   # apiserver.py: pods, before admission

What is played: which pods get the proxy, where it goes in the spec (its securityContext is what
Istio's CNI mode gives it, which passes PodSecurity `restricted`), and its life: a process that
runs until SIGTERM (its image: `proxy_image`). `inbound_intercepted` says which of a pod's
inbound ports Istio sends through the proxy (`traffic.sidecar.istio.io/includeInboundPorts`,
`excludeInboundPorts`), which decides whether a pod without a sidecar can reach it in STRICT
mode. On the pod network (`Cluster(pod_network=True)`), `MeshAgent` enforces that verdict with
nftables in each meshed pod's namespace (a table of its own beside the NetworkPolicy agent's): a
new TCP connection from an address that is not a meshed pod's, to an intercepted port, is
reset. What is not played: Envoy itself (nothing is redirected or encrypted; a meshed client
connects directly), and the moment of refusal (Envoy accepts, then closes the connection when the
TLS handshake does not come; here the connection is refused at once).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading

from kubernetes import client as k8s

from .runtime import Image, python_paths

log = logging.getLogger("cluster.sidecar")

INJECTION_LABEL = "istio-injection"  # on the namespace: "enabled"
INJECT = "sidecar.istio.io/inject"  # on the pod (label, or the older annotation): "false" opts out
NATIVE = "sidecar.istio.io/nativeSidecar"  # on the pod: "false" asks for the classic container
INCLUDE_INBOUND = "traffic.sidecar.istio.io/includeInboundPorts"
EXCLUDE_INBOUND = "traffic.sidecar.istio.io/excludeInboundPorts"
PROXY_IMAGE = "docker.io/istio/proxyv2:1.27.3"
PROXY_UID = 1337  # Istio's proxy user

# The proxy stand-in: up until the kubelet's SIGTERM (Envoy drains, then exits 0).
PROXY_SCRIPT = """import signal, sys
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print("istio-proxy: ready", flush=True)
while True:
    signal.pause()
"""


def proxy_image(folder: str) -> Image:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "pilot-agent")
    with open(path, "w") as f:
        f.write(f"#!{sys.executable}\n{PROXY_SCRIPT}")
    os.chmod(path, 0o755)
    return Image(PROXY_IMAGE, {"PATH": "/image/bin:/usr/bin:/bin"}, uid=PROXY_UID, gid=PROXY_UID, workdir="/", home="/",
                 paths=python_paths(), layers={"/image/bin": folder})


def opted_out(pod: dict) -> bool:
    meta = pod.get("metadata") or {}
    return any((meta.get(where) or {}).get(INJECT, "").lower() == "false" for where in ("labels", "annotations"))


class IstioInjector:
    def __init__(self):
        self.injected: list[str] = []  # "namespace/pod" of every pod given a proxy

    def inject(self, store, namespace: str, pod: dict) -> None:
        """The webhook's verdict on a pod being created in `namespace` (`store`'s lock held)."""
        ns = store.objects.get(("namespaces", "", namespace)) or {}
        if (ns.get("metadata", {}).get("labels") or {}).get(INJECTION_LABEL) != "enabled" or opted_out(pod):
            return
        spec, meta = pod.setdefault("spec", {}), pod.setdefault("metadata", {})
        proxy = proxy_container()
        if (meta.get("annotations") or {}).get(NATIVE, "").lower() == "false":
            spec["containers"] = spec.get("containers", []) + [proxy]
        else:  # first of the init containers, so the pod's own start behind it
            spec["initContainers"] = [{**proxy, "restartPolicy": "Always"}] + spec.get("initContainers", [])
        meta.setdefault("annotations", {})["sidecar.istio.io/status"] = '{"containers":["istio-proxy"]}'
        meta.setdefault("labels", {})["security.istio.io/tlsMode"] = "istio"
        self.injected.append(f"{namespace}/{meta.get('name', '')}")


def proxy_container() -> dict:
    return {"name": "istio-proxy", "image": PROXY_IMAGE, "command": ["pilot-agent"],
            "args": ["proxy", "sidecar"],
            "resources": {"requests": {"cpu": "10m", "memory": "40Mi"}, "limits": {"memory": "128Mi"}},
            "securityContext": {"runAsUser": PROXY_UID, "runAsGroup": PROXY_UID, "runAsNonRoot": True,
                                "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                "readOnlyRootFilesystem": True, "seccompProfile": {"type": "RuntimeDefault"}}}


def meshed(pod: dict) -> bool:
    return "sidecar.istio.io/status" in ((pod.get("metadata") or {}).get("annotations") or {})


def inbound_ports(pod: dict) -> tuple[str, set[str]]:
    """("*" | "" | "p1,p2", excluded ports) of the pod's inbound redirection."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    include = annotations.get(INCLUDE_INBOUND, "*").strip()
    exclude = {p.strip() for p in annotations.get(EXCLUDE_INBOUND, "").split(",") if p.strip()}
    return include, exclude


def inbound_intercepted(pod: dict, port: int) -> bool:
    """Whether Istio's traffic redirection (its CNI plugin or init container) sends inbound
    traffic to `port` of this pod through the proxy, as the pod's annotations say: with
    `includeInboundPorts` only those ports ("*": all; "": none), else every port; then never
    an `excludeInboundPorts` one. Intercepted, a STRICT mesh refuses a plaintext client."""
    if not meshed(pod):
        return False
    include, exclude = inbound_ports(pod)
    included = include == "*" or str(port) in {p.strip() for p in include.split(",") if p.strip()}
    return included and str(port) not in exclude


MESH_TABLE = "istio_mtls"


def strict_rules(pod: dict, meshed_ips: set[str]) -> str:
    """The meshed pod's table: a new plaintext TCP connection (a SYN from an address that is not a
    meshed pod's) to an intercepted port is reset. Stateless, so the pod's own connections and
    their replies are never touched."""
    include, exclude = inbound_ports(pod)
    lines = [f"table inet {MESH_TABLE}", f"delete table inet {MESH_TABLE}", f"table inet {MESH_TABLE} {{", "  chain inbound {",
             "    type filter hook input priority 0; policy accept;", '    iif "lo" accept']
    v4, v6 = sorted(a for a in meshed_ips if ":" not in a), sorted(a for a in meshed_ips if ":" in a)
    lines += [f"    ip saddr {{ {', '.join(v4)} }} accept"] if v4 else []
    lines += [f"    ip6 saddr {{ {', '.join(v6)} }} accept"] if v6 else []
    lines += [f"    tcp dport {{ {', '.join(sorted(exclude))} }} accept"] if exclude else []
    if include == "*":
        lines.append("    tcp flags & (syn | ack) == syn reject with tcp reset")
    elif include:
        lines.append(f"    tcp dport {{ {include} }} tcp flags & (syn | ack) == syn reject with tcp reset")
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


class MeshAgent:
    """STRICT mTLS, as far as a pod without a sidecar sees it, on the pod network: every half
    second, each meshed pod of the node gets its table from the pods the API lists."""

    def __init__(self, api: k8s.ApiClient, network, interval: float = 0.5):
        self.core, self.network, self.interval = k8s.CoreV1Api(api), network, interval
        self.applied: dict[str, str] = {}  # pod uid -> its table now
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="istio-mtls-agent")

    def start(self) -> "MeshAgent":
        self.thread.start()
        return self

    def close(self) -> None:
        self.closed.set()

    def sync(self) -> None:
        pods = json.loads(self.core.list_pod_for_all_namespaces(_preload_content=False).data)["items"]
        local = dict(self.network.pods)  # uid -> PodNet
        ips = {ip for p in pods if meshed(p) and p["metadata"]["uid"] in local for ip in local[p["metadata"]["uid"]].ips}
        for pod in pods:
            uid = pod["metadata"]["uid"]
            if not meshed(pod) or uid not in local:
                continue
            rules = strict_rules(pod, ips)
            if self.applied.get(uid) != rules:
                done = subprocess.run([*local[uid].enter(), "nft", "-f", "-"], input=rules, capture_output=True, text=True)
                if done.returncode != 0:
                    raise RuntimeError(f"nft for {pod['metadata']['name']}: {done.stderr.strip()}\n{rules}")
                self.applied[uid] = rules

    def _loop(self) -> None:
        while not self.closed.wait(self.interval):
            try:
                self.sync()
            except Exception as exc:  # a pod's namespace just removed, the API busy: next round
                log.info("istio mtls agent: %s", exc)
