"""The Argo documents of each pipeline: a WorkflowTemplate holding the DAG, a Workflow that runs
it by reference (`workflowTemplateRef`), and — for retraining — a CronWorkflow that runs it on a
schedule. Every setting a user tunes per run is a workflow parameter; what is fixed per cluster
(image, PVC, MLflow Secret, schedule, the service account, each step's resources) is chosen
when rendering: a run's parameters reach only command-line arguments, never the pod spec.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hera.workflows import DAG, Artifact, CronWorkflow, Parameter, Task, Workflow, WorkflowTemplate
from hera.workflows import models as m

from kubernetes.utils.quantity import parse_quantity

from elastic_step import defaults
from elastic_step.argo import steps
from elastic_step.argo.security import restricted_pod
from elastic_step.argo.workers import WorkerPods
from elastic_step.errors import ConfigError
from elastic_step.images import default_image
from elastic_step.schedule import argo_cron, check_timezone

PIPELINES = ("training", "retraining")
DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# A Kubernetes quantity as the API server's own grammar has it (digits, a fraction, an SI or
# binary suffix, or an exponent): nothing else can reach a pod spec.
DATA_STORE = re.compile(r"^[a-z][a-z0-9+.-]*://[A-Za-z0-9._~/:@%+=,-]+$")
ENDPOINT = re.compile(r"^https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?/?$")
QUANTITY = re.compile(r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[mkMGTPE]|[eE][+-]?[0-9]+)?$")


def check_quantity(flag: str, value: str) -> None:
    if not QUANTITY.match(str(value)) or float(parse_quantity(str(value))) <= 0:
        raise ConfigError(f"{flag} {value!r} is not a positive Kubernetes quantity (e.g. 500m or 2 for CPU, 512Mi or 4Gi "
                          "for memory)")
LABELS = {"app.kubernetes.io/name": "elastic-step", "app.kubernetes.io/part-of": "elastic-step"}
# Step pods only (podMetadata): deploy/mlflow's NetworkPolicy admits them; worker pods never call MLflow.
STEP_POD_LABELS = {**LABELS, defaults.MLFLOW_CLIENT_LABEL[0]: defaults.MLFLOW_CLIENT_LABEL[1]}

# Workflow parameters and their defaults: a run overrides any of them (`argo submit -p epochs=10`).
PARAMETERS = {
    "source": defaults.SOURCE,
    "label": defaults.LABEL,
    # prepare-data's --categorical (as the KFP pipelines' `categorical`): the string columns a mode=ps
    # model's tables index, e.g. `auto`; "" (the default) turns no column into ids.
    "categorical": "",
    # prepare-data's --split (TRAIN,VAL,TEST fractions) and --rows-per-shard, as the KFP pipelines' `split`
    # and `rows_per_shard` go to prepare_data.
    "split": defaults.SPLIT,
    "rows-per-shard": str(defaults.ROWS_PER_SHARD),
    "model-def": defaults.MODEL_DEF,
    "workers": defaults.WORKERS,
    "spares": str(defaults.SPARES),
    "epochs": str(defaults.EPOCHS),
    "minibatch-size": str(defaults.MINIBATCH_SIZE),
    "minibatches-per-task": str(defaults.MINIBATCHES_PER_TASK),
    "global-batch-size": str(defaults.GLOBAL_BATCH_SIZE),
    "lr-scaling": defaults.LR_SCALING,
    # ps: embedding tables on shards beside the workers (processes in the step's pod, or pods with backend kubernetes).
    "mode": defaults.MODE,
    "ps-shards": str(defaults.PS_SHARDS),
    "ps-table-limit-mb": str(defaults.PS_TABLE_LIMIT_MB),  # ps: larger tables are served from the shards' snapshots
    "checkpoint-steps": str(defaults.CHECKPOINT_STEPS),
    "seed": str(defaults.SEED),
    "backend": defaults.BACKEND,
    "device": defaults.DEVICE,
    "precision": defaults.PRECISION,
    "experiment": defaults.EXPERIMENT,
    "registered-model": defaults.REGISTERED_MODEL,
    "floor": defaults.metric_pairs(defaults.FLOORS),
    "min-gain": defaults.metric_pairs(defaults.MIN_GAINS),
    # Serving the new champion (the deploy step): "" (the default) promotes only; kserve or mlflow deploys.
    "serve-target": "",
    "serve-namespace": "",
    "serve-service-account": "",
    "serve-storage-secret": "",
}
MLFLOW_URI_DEFAULT = defaults.MLFLOW_SERVICE_URI  # deploy/mlflow in deploy/'s namespace


@dataclass(frozen=True)
class RenderOptions:
    """Choices fixed when the YAML is rendered (everything else is a workflow parameter)."""

    image: str = field(default_factory=default_image)
    pvc: str | None = None
    data_store: str | None = None  # s3://bucket/prefix: the dataset there, readable by worker pods
    store_secret: str | None = None  # Secret with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY
    store_endpoint: str | None = None  # AWS_ENDPOINT_URL
    mlflow_secret: str | None = None  # NAME or NAME:KEY of a Secret holding the tracking URI
    mlflow_credentials: str | None = None  # a Secret with `username`, `password` and `uri` for MLflow's auth
    train_retries: int = 3
    cron: str = "0 3 * * *"
    timezone: str = "UTC"
    starting_deadline_seconds: int = 3600
    history_limit: int = 3
    service_account: str = "elastic-step-runner"  # deploy/rbac's: the train step creates worker pods
    # The deploy step's own (deploy/serving's): Deployments, Services, InferenceServices, nothing of the runner's.
    deploy_service_account: str = "elastic-step-deployer"
    train_cpu: str = "4"
    train_memory: str = "8Gi"
    train_gpus: int = 0
    step_cpu: str = "1"
    step_memory: str = "2Gi"
    # Each worker pod's resources (train's --worker-cpu/--worker-memory), fixed here like the
    # steps' own; None: the workers get none (BestEffort pods, no memory limit).
    worker_cpu: str | None = None
    worker_memory: str | None = None
    # Each parameter-server shard pod's in a run with mode ps (train's --ps-cpu/--ps-memory); None: a worker pod's.
    ps_cpu: str | None = None
    ps_memory: str | None = None
    # GPUs, scheduling and identity of each worker pod, fixed here too (argo/workers.py).
    worker_gpus: int = 0
    worker_node_selector: tuple[str, ...] = ()
    worker_tolerations: tuple[str, ...] = ()
    worker_service_account: str | None = None
    # The PriorityClass of every pod: the step pods (the workflow's podPriorityClassName; the train
    # step's pod is the master) and the worker pods (train's --priority-class). None: the cluster's default.
    priority_class: str | None = None

    def validate(self) -> None:
        if not self.image or any(c.isspace() for c in self.image):
            raise ConfigError(f"--image {self.image!r} is not an image reference; give one like ghcr.io/org/image:tag")
        if not DNS_1123_SUBDOMAIN.match(self.service_account) or len(self.service_account) > 253:
            raise ConfigError(f"--service-account {self.service_account!r} is not a valid Kubernetes name "
                              "(lower-case letters, digits, '-' and '.')")
        check_name("--deploy-service-account", self.deploy_service_account)
        if self.priority_class is not None and (not DNS_1123_SUBDOMAIN.match(self.priority_class)
                                                or len(self.priority_class) > 253):
            raise ConfigError(f"--priority-class {self.priority_class!r} is not a valid PriorityClass name "
                              "(lower-case letters, digits, '-' and '.')")
        for flag, value in (("--train-cpu", self.train_cpu), ("--train-memory", self.train_memory),
                            ("--step-cpu", self.step_cpu), ("--step-memory", self.step_memory)):
            check_quantity(flag, value)
        self.worker_pods.validate(check_name)
        if self.data_store is not None:
            if not DATA_STORE.match(self.data_store) or self.data_store.startswith("file:"):
                raise ConfigError(f"--data-store {self.data_store!r} is not an object-store URI; give one like "
                                  "s3://bucket/prefix or gs://bucket/prefix")
            if self.pvc:
                raise ConfigError("--data-store and --pvc: choose one place for the dataset")
        if self.store_endpoint is not None and not ENDPOINT.match(self.store_endpoint):
            raise ConfigError(f"--store-endpoint {self.store_endpoint!r} is not an http(s) URL (e.g. "
                              "http://minio-service.kubeflow:9000)")
        if self.train_gpus < 0:
            raise ConfigError(f"--train-gpus {self.train_gpus} must be 0 or more")
        for flag, name in (("--pvc", self.pvc), ("--mlflow-secret", self.secret_name),
                           ("--mlflow-secret", self.mlflow_credentials), ("--store-secret", self.store_secret)):
            if name is not None and not DNS_1123.match(name):
                raise ConfigError(f"{flag} {name!r} is not a valid Kubernetes name (lower-case letters, digits, '-')")
        if self.train_retries < 0:
            raise ConfigError(f"--train-retries {self.train_retries} must be 0 or more")
        if self.starting_deadline_seconds < 0 or self.history_limit < 0:
            raise ConfigError("--starting-deadline and --history-limit must be 0 or more")
        argo_cron(self.cron)
        check_timezone(self.timezone)

    @property
    def worker_pods(self) -> WorkerPods:
        return WorkerPods(cpu=self.worker_cpu, memory=self.worker_memory, gpus=self.worker_gpus,
                          node_selector=tuple(self.worker_node_selector), tolerations=tuple(self.worker_tolerations),
                          service_account=self.worker_service_account, priority_class=self.priority_class,
                          ps_cpu=self.ps_cpu, ps_memory=self.ps_memory)

    @property
    def secret_name(self) -> str | None:
        return self.mlflow_secret.partition(":")[0] if self.mlflow_secret else None

    @property
    def secret_key(self) -> str:
        return (self.mlflow_secret or "").partition(":")[2] or "tracking-uri"


def check_name(flag: str, name: str) -> None:
    """A Kubernetes object name (DNS-1123 subdomain: service accounts, PriorityClasses)."""
    if not DNS_1123_SUBDOMAIN.match(name) or len(name) > 253:
        raise ConfigError(f"{flag} {name!r} is not a valid Kubernetes name (lower-case letters, digits, '-' and '.')")


def template_name(pipeline: str) -> str:
    return f"elastic-step-{pipeline}"


def _from_workflow(*names: str) -> dict[str, str]:
    return {name: f"{{{{workflow.parameters.{name}}}}}" for name in names}


def _dataset(layout: steps.Layout) -> list:
    if not layout.dataset_is_artifact:
        return []
    return [Artifact(name="dataset", from_="{{tasks.prepare-data.outputs.artifacts.dataset}}")]


def workflow_template(pipeline: str, options: RenderOptions) -> WorkflowTemplate:
    """prepare-data → train → evaluate → (blessed) export → (blessed) promote → (serve-target) deploy."""
    if pipeline not in PIPELINES:
        raise ConfigError(f"--pipeline {pipeline!r} is not one of {', '.join(PIPELINES)}")
    layout = steps.Layout(pvc=options.pvc, data_store=options.data_store)
    settings = steps.StepSettings(image=options.image, mlflow_secret=options.secret_name,
                                  mlflow_secret_key=options.secret_key, mlflow_credentials=options.mlflow_credentials,
                                  store_secret=options.store_secret, store_endpoint=options.store_endpoint)
    step = steps.StepResources(cpu=options.step_cpu, memory=options.step_memory)
    trainer = steps.StepResources(cpu=options.train_cpu, memory=options.train_memory, gpus=options.train_gpus)
    parameters = dict(PARAMETERS)
    if settings.uri_from_parameter:
        parameters["mlflow-uri"] = MLFLOW_URI_DEFAULT
    volumes = None
    if options.pvc:
        volumes = [m.Volume(name=steps.PVC_VOLUME,
                            persistent_volume_claim=m.PersistentVolumeClaimVolumeSource(claim_name=options.pvc))]
    blessed = "{{tasks.evaluate.outputs.parameters.blessed}} == true"
    with WorkflowTemplate(
        name=template_name(pipeline),
        labels=LABELS,
        entrypoint=pipeline,
        arguments=[Parameter(name=name, value=value) for name, value in parameters.items()],
        service_account_name=options.service_account,
        # Every step pod carries the project's labels: deploy/mlflow's NetworkPolicy admits them.
        pod_metadata=m.Metadata(labels=STEP_POD_LABELS),
        # Keep failed pods (their logs explain the failure); delete finished workflows after a while.
        pod_gc=m.PodGC(strategy="OnPodSuccess"),
        ttl_strategy=m.TTLStrategy(seconds_after_success=7 * 86400, seconds_after_failure=14 * 86400),
        volumes=volumes,
        pod_priority_class_name=options.priority_class,
        security_context=restricted_pod(),  # PodSecurity `restricted` (argo/security.py)
    ) as template:
        prepare_c = steps.prepare_data(settings, layout, step)
        train_c = steps.train(settings, layout, options.train_retries, warm_start=pipeline == "retraining",
                              resources=trainer, workers=options.worker_pods)
        evaluate_c = steps.evaluate(settings, layout, step)
        export_c = steps.export(settings, layout, step)
        promote_c = steps.promote(settings, layout, step)
        deploy_c = steps.deploy(settings, layout, step, options.deploy_service_account)
        with DAG(name=pipeline):
            Task(name="prepare-data", template=prepare_c,
                 arguments=_from_workflow(*steps.PREPARE_INPUTS))
            train_args = _from_workflow(*steps.TRAIN_INPUTS)
            if pipeline == "retraining":
                train_args |= _from_workflow("registered-model")
            Task(name="train", template=train_c, depends="prepare-data",
                 arguments=[Parameter(name=k, value=v) for k, v in train_args.items()] + _dataset(layout))
            evaluate_args = {"run-id": "{{tasks.train.outputs.parameters.run_id}}",
                             "model-uri": "{{tasks.train.outputs.parameters.model_uri}}"}
            evaluate_args |= _from_workflow("registered-model", "model-def", "floor", "min-gain")
            Task(name="evaluate", template=evaluate_c, depends="train",
                 arguments=[Parameter(name=k, value=v) for k, v in evaluate_args.items()] + _dataset(layout))
            export_args = {"run-id": "{{tasks.train.outputs.parameters.run_id}}",
                           "model-uri": "{{tasks.train.outputs.parameters.model_uri}}"}
            export_args |= _from_workflow("registered-model", "model-def")
            Task(name="export", template=export_c, depends="evaluate", when=blessed,
                 arguments=[Parameter(name=k, value=v) for k, v in export_args.items()] + _dataset(layout))
            promote_args = {"version": "{{tasks.export.outputs.parameters.model_version}}"}
            promote_args |= _from_workflow("registered-model")
            Task(name="promote", template=promote_c, depends="export.Succeeded", when=blessed, arguments=promote_args)
            # only a promoted candidate, and only when a run asks for serving
            deploy_args = {"version": "{{tasks.promote.outputs.parameters.champion_version}}", "registered-model":
                           "{{workflow.parameters.registered-model}}"}
            deploy_args |= {name: f"{{{{workflow.parameters.serve-{name}}}}}" for name in steps.DEPLOY_INPUTS[2:]}
            Task(name="deploy", template=deploy_c, depends="promote.Succeeded",
                 when=f"{blessed} && '{{{{workflow.parameters.serve-target}}}}' != ''", arguments=deploy_args)
    return template


def workflow(pipeline: str) -> Workflow:
    """A run of the pipeline's WorkflowTemplate with its default parameters (`argo submit` / `kubectl create`)."""
    return Workflow(generate_name=f"{template_name(pipeline)}-", labels=LABELS,
                    workflow_template_ref=m.WorkflowTemplateRef(name=template_name(pipeline)))


def cron_workflow(options: RenderOptions) -> CronWorkflow:
    """Scheduled retraining: one run at a time; a run missed by more than the deadline is skipped."""
    return CronWorkflow(
        name=template_name("retraining"),
        labels=LABELS,
        schedules=[argo_cron(options.cron)],
        timezone=options.timezone,
        concurrency_policy="Forbid",
        starting_deadline_seconds=options.starting_deadline_seconds,
        successful_jobs_history_limit=options.history_limit,
        failed_jobs_history_limit=options.history_limit,
        workflow_template_ref=m.WorkflowTemplateRef(name=template_name("retraining")),
    )


def build_documents(pipeline: str, options: RenderOptions) -> dict[str, object]:
    """File name → Hera object, for one pipeline."""
    options.validate()
    documents: dict[str, object] = {
        f"{pipeline}-workflowtemplate.yaml": workflow_template(pipeline, options),
        f"{pipeline}-workflow.yaml": workflow(pipeline),
    }
    if pipeline == "retraining":
        documents[f"{pipeline}-cronworkflow.yaml"] = cron_workflow(options)
    return documents
