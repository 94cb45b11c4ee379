"""What a cluster run needs reaches the worker pods, from every surface that starts one: the KFP
component's inputs (worker CPU, memory, GPUs, device, precision, image, service account, node
selector, tolerations — dicts and lists as KFP passes them, or their JSON text), and `argo render`'s
options, fixed in the train step's arguments. Each chain is followed to the worker pod manifests
the Kubernetes backend builds (the same function that creates them), so a setting that is dropped
on the way fails here. Bad values: one line naming the input, exit 2, before anything starts."""


import subprocess
import sys

import pytest
import yaml
from kfp import compiler, dsl
from kfp.dsl import HTML, Dataset, Metrics, Model

import elastic_step.training_step as training_step
from elastic_step.argo import RenderOptions, build_documents
from elastic_step.backends.kubernetes.manifests import dry_run_manifests
from elastic_step.backends.kubernetes.manifests import resources
from elastic_step.backends.kubernetes.options import MasterPod, settings_from_config
from elastic_step.backends.kubernetes.ps_manifests import shard_settings
from elastic_step.cli import build_parser
from elastic_step.cli.train import train_config
from elastic_step.components import prepare_data, train_elastic
from elastic_step.components.train_elastic.placement import place_task

MASTER = MasterPod(name="train-elastic-abc", uid="0f0e-uid", ip="10.1.2.3", namespace="ml")
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


class JobStarted(Exception):
    """Raised in place of starting the job: the config it would have started with is kept."""


@pytest.fixture
def started(monkeypatch):
    """The TrainConfig a train step would run (the job itself is not started)."""
    seen = {}

    def run_job(config):
        seen["config"] = config
        raise JobStarted

    monkeypatch.setattr(training_step, "run_job", run_job)
    monkeypatch.setenv("ELASTIC_STEP_POD_NAMESPACE", "ml")
    return seen


def worker_pods(config, image_default="the-masters-own-image:1") -> list[dict]:
    settings = settings_from_config(config)
    objects = yaml.safe_load_all(dry_run_manifests(config, settings, MASTER, settings.image or image_default))
    return [o for o in objects if o and o["kind"] == "Pod"]


def run_component(tmp_path, **inputs):
    artifacts = dict(dataset=Dataset(name="dataset", uri="s3://bucket/runs/1/dataset"),
                     model=Model(name="model", uri=str(tmp_path / "model")),
                     metrics=Metrics(name="metrics", uri=str(tmp_path / "metrics")),
                     report=HTML(name="report", uri=str(tmp_path / "report")))
    return train_elastic.python_func(**artifacts, backend="kubernetes", **inputs)


def test_the_components_cluster_inputs_reach_every_worker_pod(started, tmp_path):
    with pytest.raises(JobStarted):
        run_component(tmp_path, workers="2:3", worker_cpu="500m:2", worker_memory="4Gi", worker_gpus=1, device="cuda",
                      ps_cpu="1:3", ps_memory="6Gi", ps_table_limit_mb=64.0,
                      precision="bf16", image="registry.example.com/team/elastic-step-torch:0.1.0",
                      worker_service_account="gpu-workers", node_selector={"cloud.google.com/gke-accelerator": "nvidia-l4"},
                      tolerations=[GPU_TOLERATION, "dedicated=ml:NoExecute"])
    config = started["config"]
    assert (config.device, config.precision) == ("cuda", "bf16")
    pods = worker_pods(config)
    assert len(pods) == 3
    for pod in pods:
        spec, container = pod["spec"], pod["spec"]["containers"][0]
        assert container["image"] == "registry.example.com/team/elastic-step-torch:0.1.0"
        assert container["resources"]["limits"] == {"cpu": "2", "memory": "4Gi", "nvidia.com/gpu": "1"}
        assert container["resources"]["requests"]["cpu"] == "500m"
        assert spec["serviceAccountName"] == "gpu-workers"
        assert spec["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-l4"}
        assert spec["tolerations"] == [GPU_TOLERATION, {"key": "dedicated", "operator": "Equal", "value": "ml",
                                                        "effect": "NoExecute"}]
        assert {"name": "ELASTIC_STEP_COLLECTIVE_BACKEND", "value": "nccl"} in container["env"]
    # A PS run's shard pods: their own cpu and memory, no GPU (the kubernetes backend's shard settings)
    shard = resources(shard_settings(settings_from_config(config)))
    assert (shard.requests, shard.limits) == ({"cpu": "1", "memory": "6Gi"}, {"cpu": "3", "memory": "6Gi"})
    assert config.ps_table_limit_mb == 64.0  # past it, the master serves the tables from the shard pods' snapshots


def test_the_component_takes_node_selector_and_tolerations_as_json_text(started, tmp_path):
    """The KFP UI and `kfp run submit` hand struct and list parameters over as JSON."""
    with pytest.raises(JobStarted):
        run_component(tmp_path, node_selector='{"pool": "gpu"}', tolerations='[{"key": "gpu", "value": "yes"}]')
    [pod, *_] = worker_pods(started["config"])
    assert pod["spec"]["nodeSelector"] == {"pool": "gpu"}
    assert pod["spec"]["tolerations"] == [{"key": "gpu", "operator": "Equal", "value": "yes"}]


def test_without_cluster_inputs_worker_pods_keep_the_defaults(started, tmp_path):
    with pytest.raises(JobStarted):
        run_component(tmp_path)
    [pod, *_] = worker_pods(started["config"])
    spec = pod["spec"]
    assert spec["containers"][0]["image"] == "the-masters-own-image:1"
    assert spec["serviceAccountName"] == "elastic-step-worker"
    assert "nodeSelector" not in spec and "tolerations" not in spec
    assert "nvidia.com/gpu" not in (spec["containers"][0].get("resources") or {}).get("limits", {})


@pytest.mark.parametrize("inputs, named", [
    ({"worker_gpus": -1}, "--worker-gpus"),
    ({"worker_cpu": "lots"}, "--worker-cpu"),
    ({"worker_memory": "8Gi:4Gi"}, "--worker-memory"),
    ({"ps_cpu": "lots"}, "--ps-cpu"),
    ({"ps_memory": "8Gi:4Gi"}, "--ps-memory"),
    ({"device": "tpu"}, "--device"),
    ({"precision": "fp8"}, "--precision"),
    ({"node_selector": "pool"}, "node_selector"),
    ({"node_selector": {"pool": 3}}, "node_selector"),
    ({"tolerations": [{"key": "gpu", "tolerationSeconds": 30}]}, "tolerationSeconds"),
    ({"tolerations": ["gpu:Sometimes"]}, "tolerations"),
])
def test_bad_cluster_inputs_stop_the_step_in_one_line_with_exit_2(started, tmp_path, capsys, inputs, named):
    with pytest.raises(SystemExit) as exited:
        run_component(tmp_path, **inputs)
    assert exited.value.code == 2 and "config" not in started
    err = capsys.readouterr().err.strip()
    assert err.startswith("train_elastic: ") and "\n" not in err and named in err, err


def test_a_users_pipeline_places_the_train_tasks_own_pod_with_kfp_kubernetes(tmp_path):
    """The master's pod is KFP's to create: its node selector and tolerations go in the task's
    kubernetes platform spec; the workers' travel as the component's inputs."""

    @dsl.pipeline(name="gpu-training")
    def gpu_pipeline(node_selector: dict = {"pool": "gpu"}):
        prepared = prepare_data(source="digits")
        trained = train_elastic(dataset=prepared.outputs["dataset"], backend="kubernetes", worker_gpus=2, device="cuda",
                                node_selector=node_selector, tolerations=[GPU_TOLERATION])
        place_task(trained, {"pool": "system"}, ["dedicated=ml:NoSchedule"])

    path = tmp_path / "gpu.yaml"
    compiler.Compiler().compile(gpu_pipeline, str(path))
    spec, platform = yaml.safe_load_all(path.read_text())
    task = spec["root"]["dag"]["tasks"]["train-elastic"]["inputs"]["parameters"]
    assert task["worker_gpus"]["runtimeValue"]["constant"] == 2
    assert task["tolerations"]["runtimeValue"]["constant"] == [GPU_TOLERATION]
    assert task["node_selector"]["componentInputParameter"] == "node_selector"
    executor = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-train-elastic"]
    assert executor["nodeSelector"] == {"labels": {"pool": "system"}}
    assert executor["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}]


def rendered_train_args(options: RenderOptions, parameters: dict[str, str]) -> list[str]:
    """The train step's command line as Argo runs it: the template's args with the workflow's
    parameters (its defaults, overridden by `parameters`) in place of `{{inputs.parameters.X}}`."""
    template = build_documents("training", options)["training-workflowtemplate.yaml"].build()
    values = {f"inputs.parameters.{p.name}": p.value for p in template.spec.arguments.parameters}
    values |= {f"inputs.parameters.{name}": value for name, value in parameters.items()}
    values["workflow.name"] = "elastic-step-training-x7k2p"
    train = next(t for t in template.spec.templates if t.name == "train")
    args = []
    for arg in train.container.args:
        for name, value in values.items():
            arg = arg.replace("{{%s}}" % name, str(value))
        args.append(arg)
    assert "{{" not in " ".join(args), args
    return args


def test_argo_renders_worker_gpus_scheduling_and_identity_into_the_train_step(monkeypatch):
    monkeypatch.setenv("ELASTIC_STEP_POD_NAMESPACE", "ml")
    options = RenderOptions(data_store="s3://bucket/prefix", worker_cpu="2", worker_memory="4Gi", worker_gpus=1,
                            worker_node_selector=("cloud.google.com/gke-accelerator=nvidia-l4",),
                            worker_tolerations=("nvidia.com/gpu:NoSchedule",), worker_service_account="gpu-workers",
                            image="registry.example.com/team/elastic-step-torch:0.1.0")
    args = rendered_train_args(options, {"backend": "kubernetes", "device": "cuda", "precision": "bf16"})
    parsed = build_parser().parse_args(args)
    config = train_config(parsed)
    assert (config.device, config.precision) == ("cuda", "bf16")
    [pod, *_] = worker_pods(config)
    spec, container = pod["spec"], pod["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert spec["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-l4"}
    assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert spec["serviceAccountName"] == "gpu-workers"


def test_argo_device_and_precision_are_workflow_parameters_with_the_engines_defaults():
    from elastic_step import defaults

    template = build_documents("training", RenderOptions())["training-workflowtemplate.yaml"].build()
    values = {p.name: p.value for p in template.spec.arguments.parameters}
    assert (values["device"], values["precision"]) == (defaults.DEVICE, defaults.PRECISION)
    train = next(t for t in template.spec.templates if t.name == "train")
    assert "--worker-gpus" not in train.container.args and "--node-selector" not in train.container.args


@pytest.mark.parametrize("flags, named", [
    (["--worker-gpus", "-1"], "--worker-gpus"),
    (["--worker-node-selector", "pool"], "--worker-node-selector"),
    (["--worker-toleration", "gpu:Sometimes"], "--worker-toleration"),
    (["--worker-service-account", "Not_A_Name"], "--worker-service-account"),
    (["--image-registry", "Registry.Example/team"], "--image-registry"),
])
def test_argo_render_refuses_bad_worker_options_in_one_line_with_exit_2(tmp_path, flags, named):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "elastic_step.cli", "argo", "render", "--pipeline", "training",
                           "--out", str(out), *flags], capture_output=True, text=True)
    assert done.returncode == 2 and named in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not out.exists()
