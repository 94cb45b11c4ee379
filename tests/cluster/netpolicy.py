"""NetworkPolicy enforced on the pod network (network.py), as a policy agent on a node does it
(Calico's Felix, kube-router): each pod's ingress rules written as nftables `inet` rules inside
that pod's own network namespace, so they hold for IPv4 and IPv6 alike.

The semantics are networking.k8s.io/v1's:
- a pod is isolated for ingress once any policy of its namespace selects it (`podSelector`, with
  `policyTypes` containing Ingress; without `policyTypes`, Ingress always counts); then only the
  union of those policies' `ingress` rules admits a connection; a pod no policy selects admits all;
- a rule admits its `from` peers (none listed: every source) on its `ports` (none: every port);
  a peer is `podSelector` (pods of the policy's namespace), `namespaceSelector` (every pod of the
  namespaces it selects; `{}` selects all), both (those pods of those namespaces), or `ipBlock`;
- ports are numbers or a container's named port, with `endPort`; protocol TCP unless said;
- replies to a pod's own connections and its loopback are never filtered (conntrack), as with
  every policy plugin.
Egress rules are not enforced: neither deploy/ nor the backend ships one (the agent logs a
warning naming any policy with egress, so a test that adds one sees it goes unenforced).

The agent reads pods, namespaces and policies through the API with its own token (a ClusterRole
of list verbs, as Felix has), on every pod start (before the pod's containers run) and every
`interval` seconds; a pod's ruleset is replaced in one nft transaction only when it changed."""

from __future__ import annotations

import json
import logging
import subprocess
import threading

from kubernetes import client as k8s

log = logging.getLogger("cluster.netpolicy")
TABLE = "kube-network-policy"
AGENT_USER = "system:serviceaccount:kube-system:network-policy-agent"
AGENT_RULES = [{"apiGroups": [""], "resources": ["pods", "namespaces"], "verbs": ["get", "list", "watch"]},
               {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["get", "list", "watch"]}]


def selects(selector: dict | None, labels: dict | None) -> bool:
    """A LabelSelector (matchLabels, matchExpressions) against labels; `{}` selects everything."""
    labels = labels or {}
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        if (op == "In" and labels.get(key) not in values) or (op == "NotIn" and key in labels and labels[key] in values) \
                or (op == "Exists" and key not in labels) or (op == "DoesNotExist" and key in labels):
            return False
    return True


def namespace_labels(namespace: dict) -> dict:
    # The API server labels every namespace with its name (NamespaceDefaultLabelName).
    return {**(namespace["metadata"].get("labels") or {}), "kubernetes.io/metadata.name": namespace["metadata"]["name"]}


def is_ingress(policy: dict) -> bool:
    types = policy["spec"].get("policyTypes")
    return "Ingress" in types if types else True


def egress_policies(policies: list[dict]) -> list[dict]:
    return [p for p in policies if "Egress" in (p["spec"].get("policyTypes") or []) or p["spec"].get("egress")]


class Peers:
    """Who may connect: every source (None) or a set of addresses and CIDRs."""

    def __init__(self, pods: list[dict], pod_ips: dict[str, list[str]], namespaces: dict[str, dict]):
        self.pods, self.pod_ips, self.namespaces = pods, pod_ips, namespaces

    def of(self, rule_from: list[dict] | None, namespace: str) -> set[str] | None:
        if not rule_from:
            return None
        sources: set[str] = set()
        for peer in rule_from:
            if "ipBlock" in peer:
                if peer["ipBlock"].get("except"):
                    raise RuntimeError("ipBlock.except is not enforced by this agent")
                sources.add(peer["ipBlock"]["cidr"])
                continue
            if "namespaceSelector" in peer:
                chosen = {n for n, ns in self.namespaces.items() if selects(peer["namespaceSelector"], namespace_labels(ns))}
            else:
                chosen = {namespace}
            for pod in self.pods:
                meta = pod["metadata"]
                if meta["namespace"] in chosen and selects(peer.get("podSelector"), meta.get("labels")):
                    sources.update(self.pod_ips.get(meta["uid"], []))
        return sources


def port_matches(pod: dict, rule_ports: list[dict] | None) -> list[tuple[str, str]] | None:
    """[(protocol, "port" or "low-high")] the rule opens on this pod; None: every port."""
    if not rule_ports:
        return None
    named = {p["name"]: p["containerPort"] for c in pod["spec"].get("containers", []) for p in c.get("ports") or [] if p.get("name")}
    opened = []
    for p in rule_ports:
        protocol = (p.get("protocol") or "TCP").lower()
        port = p.get("port")
        if port is None:
            opened.append((protocol, "0-65535"))
        elif isinstance(port, str) and not port.isdigit():
            if port in named:
                opened.append((protocol, str(named[port])))
        else:
            opened.append((protocol, f"{port}-{p['endPort']}" if p.get("endPort") else str(port)))
    return opened


def ruleset(allowed: list[tuple[set[str] | None, list[tuple[str, str]] | None]] | None) -> str:
    """The pod's nft table, replaced whole. `allowed` None: not isolated (no filtering)."""
    lines = [f"table inet {TABLE}", f"delete table inet {TABLE}", f"table inet {TABLE} {{", "  chain ingress {"]
    if allowed is None:
        # Nothing filtered, but connection tracking on from the pod's first packet, as a node's
        # conntrack tracks every pod's traffic: a namespace's conntrack starts only with a rule
        # that asks for it, and a connection it first sees mid-stream (the master's watch, opened
        # before its own policy selected it) is `new`, so the isolated ruleset would drop every
        # reply on it for good.
        lines += ["    type filter hook input priority 0; policy accept;", "    ct state established,related accept"]
    else:
        lines += ["    type filter hook input priority 0; policy drop;", '    iif "lo" accept',
                  "    ct state established,related accept",
                  # neighbour discovery: IPv6's ARP, which a policy never filters
                  "    icmpv6 type { nd-neighbor-solicit, nd-neighbor-advert, nd-router-advert } accept"]
        for sources, ports in allowed:
            matches = [""]
            if sources is not None:
                v4 = sorted(s for s in sources if ":" not in s)
                v6 = sorted(s for s in sources if ":" in s)
                matches = ([f"ip saddr {{ {', '.join(v4)} }} "] if v4 else []) + ([f"ip6 saddr {{ {', '.join(v6)} }} "] if v6 else [])
            for source in matches:
                for protocol, port in ports if ports is not None else [(None, None)]:
                    lines.append(f"    {source}{f'{protocol} dport {port} ' if protocol else ''}accept")
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


def pod_rules(pod: dict, policies: list[dict], peers: Peers) -> str:
    meta = pod["metadata"]
    chosen = [p for p in policies if p["metadata"]["namespace"] == meta["namespace"] and is_ingress(p)
              and selects(p["spec"].get("podSelector"), meta.get("labels"))]
    if not chosen:
        return ruleset(None)
    allowed = []
    for policy in chosen:
        for rule in policy["spec"].get("ingress") or []:
            sources = peers.of(rule.get("from"), policy["metadata"]["namespace"])
            if sources is not None and not sources:
                continue  # a rule whose peers match no pod yet admits nobody
            allowed.append((sources, port_matches(pod, rule.get("ports"))))
    return ruleset(allowed)


class PolicyAgent:
    """Keeps every local pod's nft rules in line with the policies (see the module's doc)."""

    def __init__(self, api: k8s.ApiClient, network, interval: float = 0.5):
        self.core, self.networking = k8s.CoreV1Api(api), k8s.NetworkingV1Api(api)
        self.network = network
        self.interval = interval
        self.applied: dict[str, str] = {}  # netns -> its ruleset now
        self.warned: set[str] = set()  # policies with egress, warned about once
        self.lock = threading.Lock()
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="network-policy-agent")

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.closed.set()

    def _list(self, call) -> list[dict]:
        return json.loads(call(_preload_content=False).data)["items"]

    def sync(self) -> None:
        with self.lock:
            pods = self._list(self.core.list_pod_for_all_namespaces)
            namespaces = {n["metadata"]["name"]: n for n in self._list(self.core.list_namespace)}
            policies = self._list(self.networking.list_network_policy_for_all_namespaces)
            for policy in egress_policies(policies):
                if policy["metadata"]["uid"] in self.warned:
                    continue
                self.warned.add(policy["metadata"]["uid"])
                log.warning("NetworkPolicy %s/%s: egress is not enforced by this agent", policy["metadata"]["namespace"],
                            policy["metadata"]["name"])
            local = dict(self.network.pods)  # uid -> PodNet of the pods on this node's network
            peers = Peers(pods, {uid: net.ips for uid, net in local.items()}, namespaces)
            for pod in pods:
                net = local.get(pod["metadata"]["uid"])
                if net is None:
                    continue
                rules = pod_rules(pod, policies, peers)
                if self.applied.get(net.netns) != rules:
                    self._apply(net, rules)
            for netns in set(self.applied) - {net.netns for net in local.values()}:
                del self.applied[netns]

    def _apply(self, net, rules: str) -> None:
        result = subprocess.run([*net.enter(), "nft", "-f", "-"], input=rules, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"nft in {net.netns}: {result.stderr.strip()}\n{rules}")
        self.applied[net.netns] = rules

    def _loop(self) -> None:
        while not self.closed.wait(self.interval):
            try:
                self.sync()
            except Exception as exc:  # the API busy or a pod's namespace just removed: next round
                log.info("network policy agent: %s", exc)
