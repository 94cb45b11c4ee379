"""A cluster that shares nothing with the code under test, for tests: an API server stand-in over
HTTPS (apiserver.py) enforcing `deploy/`'s RBAC (rbac.py), and a kubelet (kubelet.py) that runs
each pod's containers in their own filesystem view. The code under test reaches it only as a
pod does: KUBERNETES_SERVICE_HOST/PORT and a mounted service-account folder (token, ca.crt,
namespace).

    with Cluster(tmp_path) as cluster:
        api = cluster.core()                       # the admin's CoreV1Api (the real client)
        api.create_namespaced_pod("ml", pod)       # the kubelet binds and runs it
        cluster.used(cluster.service_account_user) # what the master's service account did
"""

from __future__ import annotations

import datetime
import ipaddress
import os

import yaml
from kubernetes import client as k8s

from .apiserver import ApiServer
from .kubelet import Kubelet
from .runtime import DockerRuntime, Image, ImageRuntime, venv_image
from .scheduling import SCHEDULER_RULES, SCHEDULER_USER, Scheduler, node_object
from .rbac import DEPLOY_RBAC, REPO, SUPERUSER, Authorizer, kustomize_namespace, read_manifests, service_account_user

__all__ = ["Cluster", "Image", "venv_image", "role_rules"]

NODE = "node-1"
KUBELET_USER = f"system:node:{NODE}"
KUBELET_RULES = [  # what the kubelet stand-in calls (the Node authorizer's share of it)
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "delete"]},
    {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["update", "patch"]},
    {"apiGroups": [""], "resources": ["pods/binding"], "verbs": ["create"]},
    {"apiGroups": [""], "resources": ["secrets", "configmaps"], "verbs": ["get"]},
    {"apiGroups": [""], "resources": ["serviceaccounts/token"], "verbs": ["create"]},
]


def deploy_namespace() -> str:
    """The namespace `kubectl apply -k deploy/` puts everything in."""
    with open(os.path.join(REPO, "deploy", "kustomization.yaml"), encoding="utf-8") as f:
        return yaml.safe_load(f).get("namespace") or "default"


def role_rules(folder: str = DEPLOY_RBAC) -> set[tuple[str, str]]:
    """(verb, resource) of every rule of the Roles shipped in deploy/rbac."""
    granted = set()
    for obj in read_manifests(folder):
        if obj["kind"] == "Role":
            for rule in obj.get("rules") or []:
                granted |= {(verb, resource) for verb in rule["verbs"] for resource in rule["resources"]}
    return granted


def make_certificates(folder: str, addresses: list[str] | tuple[str, ...] = ()) -> tuple[str, str, str]:
    """A CA and a server certificate for 127.0.0.1 (and `addresses`: where pods reach the API
    server on a pod network) signed by it: (ca.crt, server.crt, server.key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cluster-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    server = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
              .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
              .add_extension(x509.SubjectAlternativeName([*(x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", *addresses)),
                                                          x509.DNSName("kubernetes.default.svc")]), critical=False)
              .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
              .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
              .sign(ca_key, hashes.SHA256()))
    os.makedirs(folder, exist_ok=True)
    paths = [os.path.join(folder, n) for n in ("ca.crt", "server.crt", "server.key")]
    with open(paths[0], "wb") as f:
        f.write(ca.public_bytes(serialization.Encoding.PEM))
    with open(paths[1], "wb") as f:
        f.write(server.public_bytes(serialization.Encoding.PEM))
    with open(paths[2], "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    os.chmod(paths[2], 0o600)
    return paths[0], paths[1], paths[2]


class Cluster:
    """An API server and one node. `namespace`: where `deploy/rbac` is applied (the
    kustomization's own namespace by default); namespaces `default` and `other` exist too."""

    def __init__(self, root: str, namespace: str | None = None, images: dict[str, Image] | None = None,
                 isolate: bool | None = None, docker=None, allocatable: dict[str, str] | None = None,
                 pod_network: bool = False, ipv6: bool = False, docker_by_image: bool = False):
        """`docker`: a started runtime.DockerDaemon: containers run as Docker containers of their
        image's `docker` image (`--network host`, or with `pod_network` in each pod's sandbox
        container's network); else the process runtime. `allocatable`: the
        node's cpu/memory/pods (scheduling.DEFAULT_ALLOCATABLE for what is not given).
        `pod_network`: each pod in a network namespace and address of its own on the cluster's own
        bridge, NetworkPolicies enforced (network.py, netpolicy.py; namespaces or Docker runtime), `ipv6`
        with IPv6 pod addresses first; pods reach the node's servers through `pod_url`.
        `docker_by_image`: with `docker`, only the images that name a Docker image run on it, the
        others on the process runtime (runtime.ImageRuntime)."""
        from elastic_step.images import default_image

        self.root = str(root)
        self.namespace = namespace or deploy_namespace()
        self.project_image = default_image()
        self.images = {self.project_image: venv_image(self.project_image), **(images or {})}
        self.isolate = isolate
        self.docker = docker
        self.docker_by_image = docker_by_image
        self.authorizer = Authorizer()
        self.admin_token = self.authorizer.issue_token(SUPERUSER)
        self.server: ApiServer | None = None
        self.kubelet: Kubelet | None = None
        self.scheduler: Scheduler | None = None
        self.allocatable = allocatable
        self.pod_network, self.ipv6 = pod_network, ipv6
        self.network = None  # network.PodNetwork when pod_network
        self.policy_agent = None
        self.service_account = ""  # the master's, from deploy/rbac

    # -- life ---------------------------------------------------------------------------------------
    def __enter__(self) -> "Cluster":
        if self.pod_network:
            from .network import PodNetwork

            self.network = PodNetwork(ipv6=self.ipv6).start()
        self.ca, cert, key = make_certificates(os.path.join(self.root, "pki"), self.network.gateways if self.network else ())
        self.server = ApiServer(self.authorizer, cert, key)
        self.server.start()
        api = self.core()
        with open(self.ca) as f:
            ca_text = f.read()
        for ns in dict.fromkeys(["default", self.namespace, "other"]):
            api.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=ns)))
            api.create_namespaced_service_account(ns, k8s.V1ServiceAccount(metadata=k8s.V1ObjectMeta(name="default")))
            api.create_namespaced_config_map(ns, k8s.V1ConfigMap(metadata=k8s.V1ObjectMeta(name="kube-root-ca.crt"),
                                                                 data={"ca.crt": ca_text}))
        # deploy/'s RBAC for the runner, as `kubectl apply -k deploy/` makes it: the master's Role and
        # the reads KFP's launcher makes with a task pod's token (deploy/kfp/launcher).
        launcher = read_manifests(os.path.join(REPO, "deploy", "kfp", "launcher"))
        for obj in kustomize_namespace(read_manifests() + launcher, self.namespace):
            if obj["kind"] == "ServiceAccount":
                api.create_namespaced_service_account(self.namespace, obj)
                if not self.service_account:
                    self.service_account = obj["metadata"]["name"]
            else:
                self.authorizer.apply(obj)
        # The master's service account is the one the RoleBinding binds.
        bound = [s["name"] for o in read_manifests() if o["kind"] == "RoleBinding" for s in o.get("subjects") or []
                 if s.get("kind") == "ServiceAccount"]
        self.service_account = bound[0] if bound else self.service_account
        self.authorizer.add_role("", "kubelet", KUBELET_RULES)
        self.authorizer.add_binding("", {"kind": "ClusterRole", "name": "kubelet"}, [{"kind": "User", "name": KUBELET_USER}])
        self.kubelet = Kubelet(self.core(self.authorizer.issue_token(KUBELET_USER)), os.path.join(self.root, "node"),
                               self.images, self.network.gateway if self.network else "127.0.0.1", self.server.port,
                               isolate=self.isolate, runtime=self._runtime(),
                               network=self.network, policy_agent=self._policy_agent())
        self.server.log_reader = self.kubelet.read_log
        self.kubelet.start()
        api.create_node(node_object(NODE, "127.0.0.1", self.allocatable))
        self.authorizer.add_role("", "scheduler", SCHEDULER_RULES)
        self.authorizer.add_binding("", {"kind": "ClusterRole", "name": "scheduler"}, [{"kind": "User", "name": SCHEDULER_USER}])
        self.scheduler = Scheduler(self.core(self.authorizer.issue_token(SCHEDULER_USER)), NODE)
        self.scheduler.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
        if self.policy_agent is not None:
            self.policy_agent.close()
        if self.kubelet is not None:
            self.kubelet.close()
        if self.network is not None:
            self.network.stop()
        if self.server is not None:
            self.server.close()

    def _runtime(self):
        if self.docker is None:
            return None  # the kubelet's process runtime
        return ImageRuntime(self.docker) if self.docker_by_image else DockerRuntime(self.docker)

    def _policy_agent(self):
        """The pod network's NetworkPolicy agent, with its own token (netpolicy.AGENT_RULES)."""
        if self.network is None:
            return None
        from .netpolicy import AGENT_RULES, AGENT_USER, PolicyAgent

        self.network.expose(self.server.port)
        self.authorizer.add_role("", "network-policy-agent", AGENT_RULES)
        self.authorizer.add_binding("", {"kind": "ClusterRole", "name": "network-policy-agent"}, [{"kind": "User", "name": AGENT_USER}])
        self.policy_agent = PolicyAgent(k8s.ApiClient(self.configuration(self.authorizer.issue_token(AGENT_USER))), self.network)
        self.policy_agent.start()
        return self.policy_agent

    def pod_url(self, url: str) -> str:
        """A node's loopback server (`http://127.0.0.1:PORT/...`: S3, MLflow) as pods call it:
        unchanged on the node's network, through the gateway's relay on a pod network."""
        return self.network.url(url) if self.network else url

    def set_allocatable(self, **allocatable: str) -> None:
        """Change what the node offers (`cpu="2"`, `memory="4Gi"`, `pods="3"`), as a node whose
        capacity is taken or given back reports it: pods that no longer fit stay Pending."""
        api = self.core()
        node = api.read_node(NODE)
        node.status.allocatable = {**node.status.allocatable, **allocatable}
        api.replace_node_status(NODE, node)

    # -- talking to it ------------------------------------------------------------------------------
    def configuration(self, token: str | None = None) -> k8s.Configuration:
        configuration = k8s.Configuration()
        configuration.host = self.server.url
        configuration.ssl_ca_cert = self.ca
        configuration.api_key = {"authorization": f"Bearer {token or self.admin_token}"}
        return configuration

    def core(self, token: str | None = None) -> k8s.CoreV1Api:
        return k8s.CoreV1Api(k8s.ApiClient(self.configuration(token)))

    def networking(self, token: str | None = None) -> k8s.NetworkingV1Api:
        return k8s.NetworkingV1Api(k8s.ApiClient(self.configuration(token)))

    def apply(self, objects: list[dict], namespace: str | None = None) -> None:
        """`kubectl apply` of RBAC objects and ServiceAccounts (deploy/'s overlays, or KFP's and
        Kubeflow's own roles: rbac.read_platform) into `namespace`; a ServiceAccount already
        there is kept."""
        namespace = namespace or self.namespace
        for obj in kustomize_namespace(objects, namespace):
            if obj["kind"] != "ServiceAccount":
                self.authorizer.apply(obj)
            elif self.server.get("serviceaccounts", namespace, obj["metadata"]["name"]) is None:
                self.core().create_namespaced_service_account(namespace, obj)

    def kubeconfig(self, folder, user: str, token: str) -> str:
        """A kubeconfig file (mode 600) of `user` with `token`, its current context the job's
        namespace: what kubectl and `elastic-step --backend kubernetes` read from a laptop."""
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": user,
            "clusters": [{"name": "stand-in", "cluster": {"server": self.server.url, "certificate-authority": self.ca}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": user, "context": {"cluster": "stand-in", "user": user, "namespace": self.namespace}}],
        }
        path = os.path.join(str(folder), f"{user}.kubeconfig")
        with open(path, "w") as f:
            yaml.safe_dump(config, f)
        os.chmod(path, 0o600)
        return path

    def token_for(self, namespace: str, account: str) -> str:
        """A token of a ServiceAccount (a TokenRequest, as the kubelet makes for a pod)."""
        request = k8s.AuthenticationV1TokenRequest(spec=k8s.V1TokenRequestSpec(audiences=[]))
        return self.core().create_namespaced_service_account_token(account, namespace, request).status.token

    def service_account_folder(self, folder: str, namespace: str | None = None, account: str | None = None) -> str:
        """What a pod of `account` finds at /var/run/secrets/kubernetes.io/serviceaccount."""
        namespace, account = namespace or self.namespace, account or self.service_account
        os.makedirs(folder, exist_ok=True)
        for name, text in (("token", self.token_for(namespace, account)), ("namespace", namespace), ("ca.crt", open(self.ca).read())):
            with open(os.path.join(folder, name), "w") as f:
                f.write(text)
        return folder

    def in_cluster_env(self, service_account_folder: str) -> dict[str, str]:
        """The environment of a process that reaches the API as a pod does."""
        return {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(self.server.port),
                "ELASTIC_STEP_SERVICEACCOUNT_DIR": service_account_folder}

    # -- for assertions -----------------------------------------------------------------------------
    @property
    def service_account_user(self) -> str:
        return service_account_user(self.namespace, self.service_account)

    def used(self, user: str | None = None) -> set[tuple[str, str, str]]:
        """(verb, resource, namespace) of every allowed request of `user` (the master's service account),
        but the reviews of its own rights (its pre-flight), which every user may ask and no Role grants."""
        from .rbac import REVIEWS

        reviews = {plural for _, plural in REVIEWS}
        return {u for u in self.server.used(user or self.service_account_user) if u[1] not in reviews}

    def refused(self, user: str | None = None) -> set[tuple[str, str, str]]:
        user = user or self.service_account_user
        return {(v, r, n) for u, v, r, n, ok in list(self.server.audit) if u == user and not ok}

    def pods(self, namespace: str | None = None, selector: str | None = None) -> list[dict]:
        from .apiserver import label_matches

        return [p for p in self.server.objects("pods", namespace or self.namespace)
                if label_matches(p["metadata"].get("labels"), selector)]

    def objects(self, plural: str, namespace: str | None = None) -> list[dict]:
        return self.server.objects(plural, namespace or self.namespace)
