"""Argo's workflow controller for one step of a Workflow, on the cluster stand-in. Read from
argoproj/argo-workflows v3.6 and v4 (workflow/controller/operator.go `executeTemplate`,
`processNodeRetries`, `assessNodeStatus`, `inferFailedReason`, `podReconciliation`;
workflow/artifactrepositories; workflow/controller/workflowpod.go through argo.py).

    controller = WorkflowController(cluster)
    wf = controller.submit(rendered_template, "wf-1", {"backend": "kubernetes"})  # a Workflow object
    node = controller.run_step(wf, "train", input_artifacts={...})                 # its pods, retried

- The Workflow is an `argoproj.io/v1alpha1` object in the API server: its spec is the
  WorkflowTemplate's with the run's parameters as its arguments (for `argo submit --from
  workflowtemplate/... -p`, Argo stores a `workflowTemplateRef` and the controller runs the merged
  spec it keeps in `status.storedWorkflowTemplateSpec`: the same steps); each step pod is owned by it (deleting it deletes the pods, and
  through them the master's workers); the node tree ends in its `status.nodes`.
- The artifact repository, resolved once per run as `artifactrepositories.Resolve` does: with
  `spec.artifactRepositoryRef` (configMap, key): that ConfigMap in the workflow's namespace, then
  in the controller's, else the workflow fails (`failed to find any artifact repository ...`);
  without: the `artifact-repositories` ConfigMap of the workflow's namespace, its key named by its
  `workflows.argoproj.io/default-artifact-repository` annotation (missing ConfigMap or key: next),
  then the controller's default (`artifactRepository` of `workflow-controller-configmap` in the
  controller's namespace) — possibly none, which only the executor finds out. The same ConfigMap's
  `executor` (a container: `securityContext`, `resources`) is what Argo gives each pod's `init`
  and `wait` (workflowpod.go `newExecContainer`).
- A pod the API server refuses (admission: PodSecurity, quota) is the node's Error with the
  server's message, not retried (Argo's `markNodeError` for a non-transient create error).
- Each attempt is a pod (argo.py `step_pod`): node `WF.STEP(N)` under the retry node `WF.STEP`
  when the template has a `retryStrategy` (argoretry.py decides), else node `WF.STEP`. A pod's
  every event is seen, in order (an informer that never misses one): Succeeded is the node's
  Succeeded; Failed is judged as `inferFailedReason` does (a pod status message: Failed with it;
  else init containers first, then main, then wait: `init`/`wait` non-zero is Error, `main`
  non-zero is Failed, "NAME: REASON (exit code N)"; a container that never started: Error, "Pod
  failed before NAME container starts due to REASON: MESSAGE"); a pod gone before its containers
  ended: Error, "pod deleted". The node's exit code is main's; its outputs are its
  WorkflowTaskResult's (what `wait` reported).
- The controller acts as its own (cluster-wide) service account: here the admin's client.
- A task's `when` (argowhen.py, govaluate as Argo calls it) with the run's parameters and the
  given outputs substituted: false is the node Skipped, "when 'EXPR' evaluated false", and no pod;
  an expression it cannot evaluate, or a reference it cannot resolve, is the node's Error.
Not modelled: the DAG (one step at a time; earlier steps' outputs are given), suspend, deadlines,
hooks, podGC, memoization, `failedPodRestart`, the informer's resync (the node is judged by
watching its pod), the Workflow's status beyond `phase` and `nodes`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import yaml
from kubernetes import client as k8s
from kubernetes import watch

from .argo import StepRefused, node_id, step_pod, task_when
from .argoretry import Attempt, NodePhase, StrategyError, decide, retry_variables
from .argowhen import WhenError, should_execute

GROUP, VERSION = "argoproj.io", "v1alpha1"
DEFAULT_REPOSITORY_ANNOTATION = "workflows.argoproj.io/default-artifact-repository"


class WorkflowFailed(Exception):
    """The workflow could not run at all (Argo marks it Error with this message)."""


@dataclass
class StepNode:
    name: str
    phase: NodePhase = NodePhase.RUNNING
    message: str = ""
    attempts: list[Attempt] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)  # every message the node showed, in order
    outputs: dict = field(default_factory=dict)
    gated: bool = False  # its `when` kept it from running (Skipped), or could not be evaluated (Error)


def resolve_repository(api: k8s.CoreV1Api, namespace: str, controller_namespace: str, ref: dict | None = None) -> dict:
    """The run's artifact repository ({} when none is configured anywhere)."""
    if ref:
        candidates = [(ns, ref.get("configMap") or "artifact-repositories", ref.get("key")) for ns in (namespace, controller_namespace)]
    else:
        candidates = [(namespace, "artifact-repositories", None)]
    for ns, name, key in candidates:
        try:
            config_map = json.loads(api.read_namespaced_config_map(name, ns, _preload_content=False).data)
        except k8s.ApiException as exc:
            if exc.status == 404:
                continue
            raise
        key = key or (config_map["metadata"].get("annotations") or {}).get(DEFAULT_REPOSITORY_ANNOTATION, "")
        if key in (config_map.get("data") or {}):
            return yaml.safe_load(config_map["data"][key]) or {}
    if ref:
        raise WorkflowFailed(f'failed to find any artifact repository for artifact repository ref '
                             f'"{ref.get("configMap", "")}#{ref.get("key", "")}"')
    return controller_setting(api, controller_namespace, "artifactRepository")


def controller_setting(api: k8s.CoreV1Api, controller_namespace: str, key: str) -> dict:
    """One key of the controller's `workflow-controller-configmap` (YAML), {} where unset."""
    try:
        config = json.loads(api.read_namespaced_config_map("workflow-controller-configmap", controller_namespace,
                                                           _preload_content=False).data)
    except k8s.ApiException as exc:
        if exc.status != 404:
            raise
        return {}
    return yaml.safe_load((config.get("data") or {}).get(key) or "") or {}


def infer_failed_reason(pod: dict) -> tuple[NodePhase, str]:
    """inferFailedReason: the phase and message of a Failed pod."""
    status = pod.get("status") or {}
    if status.get("message"):
        return NodePhase.FAILED, status["message"]
    order = {"main": 1, "wait": 2}
    containers = (status.get("initContainerStatuses") or []) + sorted(status.get("containerStatuses") or [],
                                                                       key=lambda c: order.get(c["name"], 3))
    if not containers:
        return NodePhase.FAILED, f"can't find failed message for pod {pod['metadata']['name']} namespace {pod['metadata']['namespace']}"
    main_ok = wait_ok = False
    for c in containers:
        state = c.get("state") or {}
        if state.get("waiting"):
            waiting = state["waiting"]
            return (NodePhase.ERROR,
                    f"Pod failed before {c['name']} container starts due to {waiting.get('reason')}: {waiting.get('message')}")
        ended = state.get("terminated")
        if not ended:
            continue
        if ended["exitCode"] == 0:
            main_ok, wait_ok = main_ok or c["name"] == "main", wait_ok or c["name"] == "wait"
            continue
        message = f"{c['name']}: {ended.get('reason')} (exit code {ended['exitCode']})"
        message += f": {ended['message']}" if ended.get("message") else ""
        if c["name"] in ("init", "wait"):
            return NodePhase.ERROR, message
        if c["name"] == "main" or ended["exitCode"] not in (137, 143):
            return NodePhase.FAILED, message
    if main_ok:
        return (NodePhase.SUCCEEDED, "") if wait_ok else (NodePhase.FAILED, "pod failed: wait container did not complete successfully")
    if wait_ok:
        return NodePhase.FAILED, "pod failed: main container did not complete successfully"
    return NodePhase.FAILED, "pod failed: neither main nor wait container completed successfully"


def workflow_phase(phase: NodePhase) -> str:
    """The Workflow's phase when its one step ends so: a skipped task leaves its DAG Succeeded."""
    return NodePhase.SUCCEEDED.value if phase == NodePhase.SKIPPED else phase.value


def main_exit_code(pod: dict) -> str | None:
    for c in (pod.get("status") or {}).get("containerStatuses") or []:
        if c["name"] == "main" and (c.get("state") or {}).get("terminated"):
            return str(c["state"]["terminated"]["exitCode"])
    return None


class SkippingClock:
    """A controller's time for tests: real time plus every backoff it was asked to wait out,
    which is recorded (`waits`) and skipped rather than slept."""

    def __init__(self):
        self.skipped, self.waits = 0.0, []

    def now(self) -> float:
        return time.time() + self.skipped

    def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.skipped += seconds


class WorkflowController:
    def __init__(self, cluster, controller_namespace: str = "argo", clock=time.time, sleep=time.sleep):
        """`clock` and `sleep`: the controller's time (a test may pass a clock whose sleep only
        moves it on, to run a 30 s backoff without waiting it out)."""
        self.cluster, self.controller_namespace = cluster, controller_namespace
        self.clock, self.sleep = clock, sleep
        self.core = cluster.core()
        self.custom = k8s.CustomObjectsApi(k8s.ApiClient(cluster.configuration()))

    def submit(self, template_doc: dict, name: str, parameters: dict[str, str], namespace: str | None = None) -> dict:
        """The Workflow `argo submit --from workflowtemplate/T -p ...` makes: the template's spec,
        the run's parameters over its defaults."""
        spec = json.loads(json.dumps(template_doc["spec"]))
        declared = (spec.get("arguments") or {}).get("parameters") or []
        unknown = set(parameters) - {p["name"] for p in declared}
        if unknown:
            raise WorkflowFailed(f"parameters {sorted(unknown)} are not declared by {template_doc['metadata']['name']}")
        spec["arguments"] = {"parameters": [{**p, "value": str(parameters.get(p["name"], p.get("value", "")))} for p in declared]}
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Workflow",
                "metadata": {"name": name, "labels": {"workflows.argoproj.io/workflow-template": template_doc["metadata"]["name"]}},
                "spec": spec}
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, namespace or self.cluster.namespace, "workflows", body)

    def run_step(self, workflow: dict, template_name: str, task_outputs: dict[str, str] | None = None,
                 input_artifacts: dict[str, dict] | None = None, on_attempt=None, prepare=None, timeout: float = 600) -> StepNode:
        """Run one template of the Workflow to its end, retries included. A test's hooks:
        `prepare(pod)` may change each pod before it is created (what an operator's podSpecPatch
        or a mutating webhook could do), `on_attempt(index, pod_name)` is called once it is."""
        namespace, name = workflow["metadata"]["namespace"], workflow["metadata"]["name"]
        spec = workflow["spec"]
        template = next(t for t in spec["templates"] if t["name"] == template_name)
        strategy = template.get("retryStrategy") or spec.get("retryStrategy")
        node = StepNode(f"{name}.{template_name}")
        repository = resolve_repository(self.core, namespace, self.controller_namespace, spec.get("artifactRepositoryRef"))
        executor = controller_setting(self.core, self.controller_namespace, "executor")
        deadline = time.monotonic() + timeout
        runs = self._when(spec, template_name, name, task_outputs or {}, node)
        while runs and not self._finished(node, strategy):
            attempt_name = f"{node.name}({len(node.attempts)})" if strategy else node.name
            try:
                pod = step_pod({"spec": spec}, template_name, name, task_outputs or {}, {}, input_artifacts or {},
                               workflow=workflow, node_name=attempt_name, repository=repository, executor=executor,
                               local=retry_variables(node.attempts) if strategy else None)
            except StepRefused as exc:
                node.phase, node.message = NodePhase.ERROR, str(exc)
                break
            if prepare is not None:
                prepare(pod)
            try:
                created = self.core.create_namespaced_pod(namespace, pod)
            except k8s.ApiException as exc:
                if exc.status not in (403, 422):  # an admission's refusal is final; anything else is Argo's requeue
                    raise
                node.phase, node.message = NodePhase.ERROR, json.loads(exc.body)["message"]
                break
            attempt = Attempt(attempt_name, pod["metadata"]["name"], started=self.clock())
            node.attempts.append(attempt)
            if on_attempt is not None:
                on_attempt(len(node.attempts) - 1, attempt.pod)
            self._follow(namespace, attempt, created.metadata.resource_version, deadline)
            attempt.outputs = self._task_result(namespace, node_id(name, attempt_name))
        node.messages.append(node.message)
        if node.phase == NodePhase.SUCCEEDED:
            node.outputs = node.attempts[-1].outputs
        self._write_status(workflow, node)
        return node

    @staticmethod
    def _when(spec: dict, template_name: str, workflow_name: str, outputs: dict[str, str], node: StepNode) -> bool:
        """Whether the task's `when` lets it run; if not, the node is Skipped (or Error) as Argo's
        DAG marks it, before any pod."""
        try:
            when = task_when(spec, template_name, workflow_name, outputs)
            if should_execute(when):
                return True
            node.phase, node.message = NodePhase.SKIPPED, f"when '{when}' evaluated false"
        except (StepRefused, WhenError) as exc:
            node.phase, node.message = NodePhase.ERROR, str(exc)
        node.gated = True
        return False

    def _finished(self, node: StepNode, strategy: dict | None) -> bool:
        """Whether the node is done after its attempts so far (waiting out a backoff first)."""
        while node.attempts:
            last = node.attempts[-1]
            if not strategy:
                node.phase, node.message = last.phase, last.message
                return True
            try:
                decision = decide(strategy, node.attempts, self.clock())
            except StrategyError as exc:
                node.phase, node.message = NodePhase.ERROR, str(exc)
                return True
            if decision.wait_until is None:
                if decision.retry:
                    return False
                node.phase, node.message = decision.phase, decision.message
                return True
            node.messages.append(decision.message)
            self.sleep(max(0.0, decision.wait_until - self.clock()))
        return False

    def _follow(self, namespace: str, attempt: Attempt, since: str, deadline: float) -> None:
        """Watch the attempt's pod from its creation, every event in order, until the node's
        phase is final."""
        seen = None
        while time.monotonic() < deadline:
            stream = watch.Watch().stream(self.core.list_namespaced_pod, namespace, field_selector=f"metadata.name={attempt.pod}",
                                          resource_version=(seen or {}).get("metadata", {}).get("resourceVersion") or since,
                                          timeout_seconds=max(1, min(60, int(deadline - time.monotonic()))))
            for event in stream:
                pod = event["raw_object"]
                if event["type"] == "DELETED":
                    attempt.phase, attempt.message = NodePhase.ERROR, "pod deleted"
                    attempt.exit_code = main_exit_code(seen or pod)
                    attempt.finished = self.clock()
                    return
                seen = pod
                phase = (pod.get("status") or {}).get("phase")
                if phase in ("Succeeded", "Failed"):
                    attempt.phase, attempt.message = (NodePhase.SUCCEEDED, "") if phase == "Succeeded" else infer_failed_reason(pod)
                    attempt.exit_code = main_exit_code(pod)
                    attempt.finished = self.clock()
                    return
                if phase == "Running":
                    attempt.phase = NodePhase.RUNNING
        raise AssertionError(f"pod {attempt.pod} of node {attempt.name} did not end in time; last seen {json.dumps(seen)[:2000]}")

    def _task_result(self, namespace: str, name: str) -> dict:
        try:
            result = self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "workflowtaskresults", name)
        except k8s.ApiException as exc:
            if exc.status == 404:
                return {}
            raise
        return result.get("outputs") or {}

    def _write_status(self, workflow: dict, node: StepNode) -> None:
        name = workflow["metadata"]["name"]
        nodes = {node_id(name, a.name): {"name": a.name, "type": "Pod", "phase": a.phase.value, "message": a.message,
                                        "outputs": {**a.outputs, **({"exitCode": a.exit_code} if a.exit_code is not None else {})}}
                 for a in node.attempts}
        if node.gated:  # Argo's NodeTypeSkipped, whether Skipped or Error
            nodes[node_id(name, node.name)] = {"name": node.name, "type": "Skipped", "phase": node.phase.value,
                                               "message": node.message}
        if node.attempts and node.attempts[0].name != node.name:
            nodes[node_id(name, node.name)] = {"name": node.name, "type": "Retry", "phase": node.phase.value, "message": node.message,
                                               "children": [node_id(name, a.name) for a in node.attempts], "outputs": node.outputs}
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, workflow["metadata"]["namespace"], "workflows", name,
                                                   {"status": {"phase": workflow_phase(node.phase), "nodes": nodes}})
