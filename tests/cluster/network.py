"""Pods on networks of their own: the cluster's pod network, inside a network namespace the
cluster makes for itself (the *sandbox*), as a bridge CNI plugin makes one on a node.

- The sandbox (`ip netns add es-PID-RANDOM`) holds a bridge with the gateway address (10.244.0.1/16,
  and fd00:10:244::1/64 with `ipv6`). It has no other interface and no route out: nothing is
  routed to or from the machine's own interfaces, and no address outside the sandbox is reachable.
- Each pod gets a network namespace of its own (`SANDBOX-pN`): `lo` (so 127.0.0.1 belongs to that
  pod alone, shared by its containers as in Kubernetes), and `eth0`, one end of a veth pair whose
  other end is on the bridge, with the pod's own address (`status.podIP`) and a default route via
  the gateway. With `ipv6` a pod is dual-stack with IPv6 first: its podIP is the IPv6 address.
- The node's servers that pods call (the API server, S3, MLflow: all on the node's loopback) are
  reached through a relay (netrelay.py) listening on the gateway inside the sandbox and
  connecting to 127.0.0.1 on the node: `expose(port)` -> "GATEWAY:port", what a Service's
  ClusterIP is to a pod. `forward(pod, port)` is `kubectl port-forward`: the test's way in.

Everything is removed on `stop()`: the relays (by their pids), the pods' namespaces, the sandbox.
Needs root, `ip` (iproute2) and `nsenter`; `available()` says whether this machine has them."""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field

RELAY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netrelay.py")
V4 = ipaddress.ip_network("10.244.0.0/16")
V6 = ipaddress.ip_network("fd00:10:244::/64")


def available() -> bool:
    """Root with iproute2, nsenter and a kernel that gives this process new network namespaces."""
    if os.geteuid() != 0 or not all(shutil.which(tool) for tool in ("ip", "nsenter", "unshare")):
        return False
    return subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode == 0


def ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


@dataclass
class PodNet:
    """One pod's network: its namespace (a name under /run/netns) and addresses, podIP first."""

    netns: str
    ips: list[str]
    veth: str
    on_remove: list = field(default_factory=list)  # called when the pod's network is removed (a runtime's sandbox)

    @property
    def ip(self) -> str:
        return self.ips[0]

    def enter(self) -> list[str]:
        """The argv prefix that runs a command in this pod's network namespace."""
        return ["nsenter", f"--net=/run/netns/{self.netns}", "--"]

    def configure(self, netns: str = "") -> None:
        """`lo` and `eth0` up in the pod's namespace, its addresses on eth0, the default route via the gateway."""
        ns = ("-n", netns or self.netns)
        ip(*ns, "link", "set", "lo", "up")
        for address in self.ips:
            if ":" in address:
                ip(*ns, "-6", "addr", "add", f"{address}/{V6.prefixlen}", "dev", "eth0", "nodad")
            else:
                ip(*ns, "addr", "add", f"{address}/{V4.prefixlen}", "dev", "eth0")
        ip(*ns, "link", "set", "eth0", "up")
        ip(*ns, "route", "add", "default", "via", str(V4.network_address + 1))

    def move_into(self, pid: int) -> None:
        """The pod's network moved into process `pid`'s network namespace (the Docker runtime's
        sandbox container, started with no network): eth0 with the pod's addresses and route, and
        the NetworkPolicy rules enforced so far. The pod's namespace is that one from then on, under
        a new name, switched to only once it is complete: the policy agent remembers what it applied
        per name, so it applies its rules there afresh, after the copy, never before it."""
        old, new = self.netns, f"{self.netns}-c"
        rules = subprocess.run([*self.enter(), "nft", "list", "ruleset"], capture_output=True, text=True).stdout
        ip("netns", "attach", new, str(pid))
        ip("-n", old, "link", "set", "eth0", "netns", new)  # a move drops its addresses: configured again
        if any(":" in address for address in self.ips):  # Docker turns IPv6 off in a namespace with no network
            script = "for c in all default lo eth0; do echo 0 > /proc/sys/net/ipv6/conf/$c/disable_ipv6; done"
            subprocess.run(["nsenter", f"--net=/run/netns/{new}", "--", "sh", "-c", script], check=True, capture_output=True)
        self.configure(new)
        if rules.strip():
            loaded = subprocess.run(["nsenter", f"--net=/run/netns/{new}", "--", "nft", "-f", "-"], input=rules,
                                    capture_output=True, text=True)
            if loaded.returncode != 0:
                raise RuntimeError(f"nft in {new}: {loaded.stderr.strip()}")
        self.netns = new
        subprocess.run(["ip", "netns", "del", old], capture_output=True)


@dataclass
class PodNetwork:
    ipv6: bool = False
    sandbox: str = field(default_factory=lambda: f"es-{os.getpid()}-{secrets.token_hex(3)}")
    pods: dict[str, PodNet] = field(default_factory=dict)  # pod uid -> its network
    relays: dict[tuple, tuple[subprocess.Popen, int]] = field(default_factory=dict)
    next_host: int = 2
    lock: threading.Lock = field(default_factory=threading.Lock)
    started: bool = False

    @property
    def gateway(self) -> str:
        """The address pods reach the node's services on (IPv4: every pod has one)."""
        return str(V4.network_address + 1)

    @property
    def gateways(self) -> list[str]:
        return [self.gateway] + ([str(V6.network_address + 1)] if self.ipv6 else [])

    def start(self) -> "PodNetwork":
        ip("netns", "add", self.sandbox)
        self.started = True
        ns = ("-n", self.sandbox)
        ip(*ns, "link", "set", "lo", "up")
        ip(*ns, "link", "add", "cni0", "type", "bridge")
        ip(*ns, "addr", "add", f"{self.gateway}/{V4.prefixlen}", "dev", "cni0")
        if self.ipv6:  # nodad: an address in use at once, as a CNI plugin's are
            ip(*ns, "-6", "addr", "add", f"{V6.network_address + 1}/{V6.prefixlen}", "dev", "cni0", "nodad")
        ip(*ns, "link", "set", "cni0", "up")
        return self

    def add_pod(self, uid: str) -> PodNet:
        with self.lock:
            n = self.next_host
            self.next_host += 1
        if n >= V4.num_addresses - 1:
            raise RuntimeError("the pod network is out of addresses")
        pod = PodNet(f"{self.sandbox}-p{n}", [str(V4.network_address + n)], f"veth{n}")
        if self.ipv6:
            pod.ips.insert(0, str(V6.network_address + n))
        ip("netns", "add", pod.netns)
        ip("-n", self.sandbox, "link", "add", pod.veth, "type", "veth", "peer", "name", "eth0", "netns", pod.netns)
        ip("-n", self.sandbox, "link", "set", pod.veth, "master", "cni0", "up")
        pod.configure()
        with self.lock:
            self.pods[uid] = pod
        return pod

    def remove_pod(self, uid: str) -> None:
        """The pod's sandbox torn down: its namespace, and with it its veth pair and address."""
        with self.lock:
            pod = self.pods.pop(uid, None)
            relays = [key for key in self.relays if key[0] == pod.netns] if pod else []
        for key in relays:
            self._stop_relay(key)
        if pod is not None:
            subprocess.run(["ip", "netns", "del", pod.netns], capture_output=True)
            for remove in pod.on_remove:
                remove()

    # -- crossing between the node and the sandbox ---------------------------------------------------
    def expose(self, port: int) -> str:
        """A node's loopback server reachable from every pod: "GATEWAY:PORT" (the same port)."""
        self._relay((self.sandbox, self.gateway, port), ("-", "127.0.0.1", port))
        return f"{self.gateway}:{port}"

    def url(self, url: str) -> str:
        """`http(s)://127.0.0.1:PORT/...` of a node's server, as pods call it."""
        prefix, _, rest = url.partition("://127.0.0.1:")
        if not rest:
            raise ValueError(f"{url}: only a server on the node's loopback can be exposed to pods")
        port, slash, path = rest.partition("/")
        return f"{prefix}://{self.expose(int(port))}{slash}{path}"

    def forward(self, uid: str, host: str, port: int) -> int:
        """`kubectl port-forward`: a port on the node's loopback that reaches `host:port` inside
        the pod's own network namespace (as the kubelet's stream server enters it)."""
        pod = self.pods[uid]
        return self._relay(("-", "127.0.0.1", 0, pod.netns, host, port), (pod.netns, host, port))

    def _relay(self, key: tuple, target: tuple[str, str, int]) -> int:
        with self.lock:
            if key in self.relays:
                return self.relays[key][1]
            listen_ns, listen_host, listen_port = key[:3]
            proc = subprocess.Popen([sys.executable, RELAY, listen_ns, listen_host, str(listen_port), *map(str, target)],
                                    stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True)
            line = proc.stdout.readline().strip()
            if not line.isdigit():
                proc.kill()
                proc.wait()
                raise RuntimeError(f"relay {key} -> {target} did not start")
            self.relays[key] = (proc, int(line))
            return int(line)

    def _stop_relay(self, key: tuple) -> None:
        with self.lock:
            proc, _ = self.relays.pop(key, (None, 0))
        if proc is not None:
            proc.kill()
            proc.wait()
            proc.stdout.close()

    def stop(self) -> None:
        for key in list(self.relays):
            self._stop_relay(key)
        for uid in list(self.pods):
            self.remove_pod(uid)
        if self.started:
            subprocess.run(["ip", "netns", "del", self.sandbox], capture_output=True)
            self.started = False
