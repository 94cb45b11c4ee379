"""Istio's sidecar injection in a Kubeflow profile namespace, as the cluster stand-in plays it
(tests/cluster/sidecar.py): which pods get the proxy, a native sidecar that the kubelet stops once
the pod's containers have ended (so a step pod ends), the classic container that keeps it running
(the Istio + Job problem), and which inbound ports the proxy would intercept.

The compiled train task in a profile namespace with injection on: test_cluster_kfp_installed.py."""

from __future__ import annotations

import time

from kubernetes import client as k8s

from cluster import Cluster
from cluster.runtime import Image, python_paths
from cluster.sidecar import INJECT, INJECTION_LABEL, NATIVE, PROXY_IMAGE, IstioInjector, inbound_intercepted, proxy_image

SHELL_IMAGE = "busybox:1.36"


def pod(name: str, script: str, labels: dict | None = None, annotations: dict | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}, "annotations": annotations or {}},
            "spec": {"restartPolicy": "Never", "containers": [{"name": "main", "image": SHELL_IMAGE, "command": ["sh", "-c", script]}]}}


def phase_after(api: k8s.CoreV1Api, namespace: str, name: str, phases: tuple[str, ...], timeout: float = 90) -> k8s.V1Pod:
    deadline = time.monotonic() + timeout
    while True:
        current = api.read_namespaced_pod(name, namespace)
        if current.status.phase in phases or time.monotonic() > deadline:
            return current
        time.sleep(0.1)


def test_a_profile_namespace_injects_the_proxy_a_native_sidecar_ends_with_the_pod_and_a_classic_one_does_not(tmp_path):
    images = {SHELL_IMAGE: Image(SHELL_IMAGE, {"PATH": "/usr/bin:/bin"}, workdir="/", home="/", paths=python_paths()),
              PROXY_IMAGE: proxy_image(str(tmp_path / "proxy"))}
    injector = IstioInjector()
    with Cluster(str(tmp_path / "cluster"), images=images) as cluster:
        cluster.server.mutators.append(injector.inject)
        api, ns = cluster.core(), cluster.namespace
        api.patch_namespace(ns, {"metadata": {"labels": {INJECTION_LABEL: "enabled"}}})
        api.create_namespaced_pod(ns, pod("native", "echo done"))
        api.create_namespaced_pod(ns, pod("classic", "echo done", annotations={NATIVE: "false"}))
        api.create_namespaced_pod(ns, pod("worker", "echo done", labels={INJECT: "false"}))

        native = phase_after(api, ns, "native", ("Succeeded", "Failed"))
        assert native.status.phase == "Succeeded", native.status
        assert [(c.name, c.restart_policy) for c in native.spec.init_containers] == [("istio-proxy", "Always")]
        deadline = time.monotonic() + 30
        while not (proxy := api.read_namespaced_pod("native", ns).status.init_container_statuses[0]).state.terminated:
            assert time.monotonic() < deadline, proxy
            time.sleep(0.1)
        assert proxy.state.terminated.exit_code == 0  # stopped by the kubelet's TERM once main had ended

        worker = phase_after(api, ns, "worker", ("Succeeded", "Failed"))
        assert worker.status.phase == "Succeeded" and not worker.spec.init_containers
        assert [c.name for c in worker.spec.containers] == ["main"]  # opted out: no proxy

        classic = api.read_namespaced_pod("classic", ns)
        assert [c.name for c in classic.spec.containers] == ["main", "istio-proxy"]
        deadline = time.monotonic() + 60
        while not any(c.name == "main" and c.state.terminated for c in classic.status.container_statuses or []):
            assert time.monotonic() < deadline, classic.status
            time.sleep(0.1)
            classic = api.read_namespaced_pod("classic", ns)
        assert classic.status.phase == "Running"  # main is done, the proxy never is
        assert injector.injected == [f"{ns}/native", f"{ns}/classic"]


def test_a_namespace_without_the_label_is_left_alone_and_the_annotations_decide_which_ports_the_proxy_intercepts():
    class Store:
        objects = {("namespaces", "", "plain"): {"metadata": {"labels": {}}},
                   ("namespaces", "", "profile"): {"metadata": {"labels": {INJECTION_LABEL: "enabled"}}}}

    injector = IstioInjector()
    plain, meshed = pod("a", "true"), pod("b", "true")
    injector.inject(Store, "plain", plain)
    injector.inject(Store, "profile", meshed)
    assert "initContainers" not in plain["spec"] and not inbound_intercepted(plain, 8000)
    assert inbound_intercepted(meshed, 8000)  # every port by default: a STRICT mesh refuses plaintext
    meshed["metadata"]["annotations"]["traffic.sidecar.istio.io/excludeInboundPorts"] = "8000"
    assert not inbound_intercepted(meshed, 8000) and inbound_intercepted(meshed, 9000)
    meshed["metadata"]["annotations"]["traffic.sidecar.istio.io/includeInboundPorts"] = ""
    assert not inbound_intercepted(meshed, 9000)  # none intercepted


def test_the_shipped_train_steps_leave_every_inbound_port_of_their_pod_to_the_master():
    """The train step's pod is the master's, with ports chosen when it starts: in a mesh, none of
    them may be intercepted, or STRICT mTLS refuses the worker pods (outside the mesh) at them.
    Argo: the committed WorkflowTemplate's train pod as the controller makes it; KFP: the compiled
    train task's pod metadata (the driver puts it on the pod, tests/cluster/kfp_driver.py)."""
    import os

    import yaml

    from cluster.argo import step_pod
    from cluster.rbac import REPO

    class Store:
        objects = {("namespaces", "", "profile"): {"metadata": {"labels": {INJECTION_LABEL: "enabled"}}}}

    with open(os.path.join(REPO, "pipelines", "argo", "training-workflowtemplate.yaml")) as f:
        document = yaml.safe_load(f)
    dataset = {"dataset": {"bucket": "artifacts", "key": "wf/prepare-data/dataset", "endpoint": "http://minio:9000"}}
    train = step_pod(document, "train", "wf", {}, {}, dataset)
    IstioInjector().inject(Store, "profile", train)
    assert train["spec"]["initContainers"][0]["name"] == "istio-proxy"
    assert not any(inbound_intercepted(train, port) for port in (1024, 8000, 29500, 65535))

    for name in ("training_pipeline", "retraining_pipeline"):
        with open(os.path.join(REPO, "pipelines", "compiled", f"{name}.yaml")) as f:
            platform = list(yaml.safe_load_all(f))[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
        task = {"metadata": {"annotations": platform["exec-train-elastic"]["podMetadata"]["annotations"]}, "spec": {"containers": []}}
        IstioInjector().inject(Store, "profile", task)
        assert not inbound_intercepted(task, 29500), (name, task["metadata"])


def test_on_the_pod_network_a_strict_mesh_refuses_plaintext_at_intercepted_ports_only(tmp_path):
    """STRICT mTLS as a pod outside the mesh meets it (MeshAgent, nftables in each meshed pod's
    namespace): a worker-like pod without a sidecar cannot open a meshed pod's port, but opens the
    same port of a pod whose annotation leaves its inbound ports alone (the train step's); a meshed
    client opens both. The injected probe pods still end (native sidecars)."""
    from cluster.sidecar import INCLUDE_INBOUND, MeshAgent
    from test_cluster_network import PROBE, SERVER, log_of, pod_network_cluster, probe_result, python_pod, wait_for

    with pod_network_cluster(tmp_path, images={PROXY_IMAGE: proxy_image(str(tmp_path / "proxy"))}) as cluster:
        cluster.server.mutators.append(IstioInjector().inject)
        agent = MeshAgent(k8s.ApiClient(cluster.configuration()), cluster.network).start()
        try:
            api, ns = cluster.core(), cluster.namespace
            api.patch_namespace(ns, {"metadata": {"labels": {INJECTION_LABEL: "enabled"}}})
            servers = {}
            for name, annotations in (("meshed", {}), ("master", {INCLUDE_INBOUND: ""})):
                body = python_pod(cluster, name, SERVER, ["8080"])
                body.metadata.annotations = annotations
                api.create_namespaced_pod(ns, body)
            for name in ("meshed", "master"):
                wait_for(lambda: "serving" in log_of(cluster, name, ns), 60, f"{name} serving")
                pod = api.read_namespaced_pod(name, ns)
                wait_for(lambda: pod.metadata.uid in agent.applied, 30, f"{name}'s mesh rules")
                servers[name] = f"{pod.status.pod_ip}:8080"
            for client, labels in (("plain", {INJECT: "false"}), ("in-mesh", {})):
                api.create_namespaced_pod(ns, python_pod(cluster, client, PROBE, list(servers.values()), labels))
            plain, in_mesh = probe_result(cluster, "plain"), probe_result(cluster, "in-mesh")
            assert (plain[servers["meshed"]], plain[servers["master"]]) == ("refused", "open"), plain
            assert (in_mesh[servers["meshed"]], in_mesh[servers["master"]]) == ("open", "open"), in_mesh
        finally:
            agent.close()
