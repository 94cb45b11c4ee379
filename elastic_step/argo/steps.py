"""The container templates of the Argo pipelines: one per CLI pipeline step (`elastic-step
prepare-data | train | evaluate | export | promote`), each writing its outputs under `--outputs`
so the template can declare them as output parameters (`valueFrom.path`) and artifacts.

Files travel between steps one of two ways (`Layout`): through the cluster's artifact repository
(outputs declared by path only and inputs `from:` the producing task, so the repository Argo is
configured with — S3, MinIO, GCS, ... — chooses the key and no bucket or credentials appear
here), or on a shared PersistentVolumeClaim mounted in every step, one folder per workflow.
The dataset may instead live in an object store (`data_store`, one folder per workflow), which
is what worker pods need: they read it themselves and share no file with the train step's pod.
"""

from __future__ import annotations

from dataclasses import dataclass

from hera.workflows import Artifact, Container, Env, FieldEnv, Parameter, Resources, SecretEnv
from hera.workflows import models as m

from elastic_step import defaults
from elastic_step.argo.security import restricted_container
from elastic_step.argo.workers import WorkerPods
from elastic_step.exit_codes import argo_retry_expression

ENTRYPOINT = "elastic-step"
PVC_MOUNT = "/mnt/elastic-step"
PVC_VOLUME = "work"


@dataclass(frozen=True)
class Layout:
    """Where a step reads its inputs and writes its outputs."""

    pvc: str | None = None  # claim name; None: the artifact repository
    data_store: str | None = None  # an object-store URI (s3://bucket/prefix): the dataset lives there

    @property
    def uses_artifacts(self) -> bool:
        return self.pvc is None

    @property
    def dataset_is_artifact(self) -> bool:
        return self.uses_artifacts and not self.data_store

    def outputs(self, step: str) -> str:
        if self.pvc:
            return f"{PVC_MOUNT}/{{{{workflow.name}}}}/{step}"
        return "/tmp/outputs"

    def dataset_in(self) -> str:
        if self.data_store:
            return f"{self.data_store.rstrip('/')}/{{{{workflow.name}}}}/dataset"
        return f"{self.outputs('prepare-data')}/dataset" if self.pvc else "/tmp/inputs/dataset"

    def dataset_out(self) -> str:
        return self.dataset_in() if self.data_store else f"{self.outputs('prepare-data')}/dataset"

    def job_dir(self) -> str:
        return f"{self.outputs('train')}/job" if self.pvc else "/tmp/job"

    def volume_mounts(self) -> list[m.VolumeMount] | None:
        return [m.VolumeMount(name=PVC_VOLUME, mount_path=PVC_MOUNT)] if self.pvc else None


@dataclass(frozen=True)
class StepSettings:
    """What every step container shares: the image and where the MLflow URI comes from."""

    image: str
    mlflow_secret: str | None = None  # Secret of the URI; None: the credentials' (key `uri`), else `mlflow-uri`
    mlflow_secret_key: str = "tracking-uri"
    mlflow_credentials: str | None = None  # Secret with `username` and `password` of an MLflow user (and `uri`)
    store_secret: str | None = None  # Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY of the data store
    store_endpoint: str | None = None  # AWS_ENDPOINT_URL (MinIO, any S3-compatible store)

    @property
    def uri_from_parameter(self) -> bool:
        """Only without credentials: a parameter's URI must never receive a password."""
        return not (self.mlflow_secret or self.mlflow_credentials)

    def env(self) -> list:
        # The steps read MLFLOW_TRACKING_URI (their --mlflow-uri default). ARGO_WORKFLOW_NAME tags the
        # MLflow runs, so a retried train step finds and resumes its own unfinished run.
        # ELASTIC_STEP_IMAGE makes worker pods launched by the train step use this same image.
        # With credentials the URI never comes from a workflow parameter (whoever submits a run sets
        # those, and could point the steps at a host that collects the password): it comes from the
        # --mlflow-secret Secret, else from the credentials' own Secret (key `uri`).
        if self.mlflow_secret:
            uri = SecretEnv(name="MLFLOW_TRACKING_URI", secret_name=self.mlflow_secret, secret_key=self.mlflow_secret_key)
        elif self.mlflow_credentials:
            uri = SecretEnv(name="MLFLOW_TRACKING_URI", secret_name=self.mlflow_credentials, secret_key="uri")
        else:
            uri = Env(name="MLFLOW_TRACKING_URI", value="{{workflow.parameters.mlflow-uri}}")
        credentials = []
        if self.mlflow_credentials:  # MLflow's basic-auth server (deploy/mlflow): a user, never a literal
            credentials = [SecretEnv(name=f"MLFLOW_TRACKING_{key.upper()}", secret_name=self.mlflow_credentials,
                                     secret_key=key) for key in ("username", "password")]
        if self.store_secret:  # by reference: the train step's worker pods take the same Secret's keys
            credentials += [SecretEnv(name=key, secret_name=self.store_secret, secret_key=key)
                            for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")]
        if self.store_endpoint:
            credentials.append(Env(name="AWS_ENDPOINT_URL", value=self.store_endpoint))
        return [uri, *credentials, Env(name="ARGO_WORKFLOW_NAME", value="{{workflow.name}}"),
                Env(name="ELASTIC_STEP_IMAGE", value=self.image)]


@dataclass(frozen=True)
class StepResources:
    """A step container's resources, fixed when the YAML is rendered (checked quantities): no
    workflow parameter reaches the pod spec, so a run cannot ask for more than the template
    allows, nor smuggle other fields in through a podSpecPatch."""

    cpu: str
    memory: str
    gpus: int = 0

    def build(self) -> Resources:
        return Resources(cpu_request=self.cpu, memory_request=self.memory, memory_limit=self.memory,
                         gpus=self.gpus or None)


# The downward API: the train step's process is the elastic master; it learns who and where it
# is from these (owner of its worker pods, the namespace they go to, the address they call).
MASTER_ENV = (("ELASTIC_STEP_POD_NAME", "metadata.name"), ("ELASTIC_STEP_POD_UID", "metadata.uid"),
              ("ELASTIC_STEP_POD_NAMESPACE", "metadata.namespace"), ("ELASTIC_STEP_POD_IP", "status.podIP"))


def _param(name: str) -> str:
    return f"{{{{inputs.parameters.{name}}}}}"


def _outputs(layout: Layout, step: str, parameters: list[str], artifacts: dict[str, str]) -> list:
    """Output parameters read from `--outputs DIR/<name>`; artifacts (name → file or folder under DIR)
    only when they go through the artifact repository."""
    out_dir = layout.outputs(step)
    declared: list = [Parameter(name=p, value_from=m.ValueFrom(path=f"{out_dir}/{p}")) for p in parameters]
    if layout.uses_artifacts:
        declared += [Artifact(name=name, path=f"{out_dir}/{path}") for name, path in artifacts.items()]
    return declared


def _inputs(layout: Layout, parameters: list[str], dataset: bool) -> list:
    declared: list = [Parameter(name=p) for p in parameters]
    if dataset and layout.dataset_is_artifact:
        declared.append(Artifact(name="dataset", path=layout.dataset_in()))
    return declared


def _container(name: str, settings: StepSettings, layout: Layout, args: list[str], inputs: list, outputs: list,
               resources: StepResources, retry_strategy: m.RetryStrategy | None = None, env: list | None = None,
               annotations: dict[str, str] | None = None, service_account: str | None = None) -> Container:
    return Container(
        name=name,
        annotations=annotations,
        service_account_name=service_account,  # None: the workflow's (spec.serviceAccountName)
        image=settings.image,
        command=[ENTRYPOINT],
        args=args,
        env=settings.env() + (env or []),
        inputs=inputs,
        outputs=outputs,
        resources=resources.build(),
        volume_mounts=layout.volume_mounts(),
        retry_strategy=retry_strategy,
        security_context=restricted_container(),  # PodSecurity `restricted` (argo/security.py)
    )


PREPARE_INPUTS = ["source", "label", "categorical", "split", "rows-per-shard", "seed"]


def prepare_data(settings: StepSettings, layout: Layout, resources: StepResources) -> Container:
    # --categorical "" (the parameter's default) names no column, as the KFP component's categorical="" does.
    out = layout.outputs("prepare-data")
    args = ["prepare-data", "--source", _param("source"), "--label", _param("label"),
            "--categorical", _param("categorical"), "--split", _param("split"),
            "--rows-per-shard", _param("rows-per-shard"), "--out", layout.dataset_out(), "--seed", _param("seed"),
            "--outputs", out]
    return _container("prepare-data", settings, layout, args, _inputs(layout, PREPARE_INPUTS, False),
                      _outputs(layout, "prepare-data", [],
                               ({"dataset": "dataset"} if layout.dataset_is_artifact else {}) | {"summary": "summary.md"}),
                      resources)


TRAIN_INPUTS = ["model-def", "workers", "spares", "epochs", "minibatch-size", "minibatches-per-task", "global-batch-size",
                "lr-scaling", "mode", "ps-shards", "ps-table-limit-mb", "checkpoint-steps", "seed", "backend", "device",
                "precision", "experiment"]


def train(settings: StepSettings, layout: Layout, retries: int, warm_start: bool, resources: StepResources,
          workers: WorkerPods = WorkerPods()) -> Container:
    args = ["train", "--model-def", _param("model-def"), "--data", layout.dataset_in(), "--job-dir", layout.job_dir()]
    for name in TRAIN_INPUTS[1:]:
        args += [f"--{name}", _param(name)]
    # Worker pods' resources, scheduling and identity: fixed at render time, never a run's parameter.
    args += workers.train_args()
    inputs = list(TRAIN_INPUTS)
    if warm_start:
        # Retraining starts from the current champion (from scratch while there is none yet); a
        # retried attempt still resumes its own run's newest checkpoint first (found by the
        # ARGO_WORKFLOW_NAME tag).
        args += ["--registered-model", _param("registered-model"), "--warm-start-alias", "champion"]
        inputs.append("registered-model")
    args += ["--outputs", layout.outputs("train")]
    return _container("train", settings, layout, args, _inputs(layout, inputs, True),
                      _outputs(layout, "train", ["run_id", "model_uri"], {"metrics": "metrics.json", "model": "model"}),
                      resources, retry_strategy=train_retry(retries),
                      env=[FieldEnv(name=n, field_path=f) for n, f in MASTER_ENV],
                      annotations=dict([defaults.ISTIO_MASTER_INBOUND]))  # its workers reach it in a mesh


# Preemptions a train step may take beyond its retries of failures: each costs a checkpoint's worth of
# work at most, and a cluster that reclaims capacity often should not end a long run for it.
PREEMPTION_RETRIES = 20


def train_retry(failure_retries: int) -> m.RetryStrategy:
    """Retry what another attempt can fix, and nothing else (elastic_step.exit_codes): a preempted
    attempt (exit 75) always, within the limit; a failure, or a pod killed or deleted before it
    could say anything, `failure_retries` times; bad input (exit 2) never. Each retry resumes the
    run's newest checkpoint (found by the ARGO_WORKFLOW_NAME tag). The backoff is capped rather
    than bounded by a maxDuration, which Argo counts from the first attempt's start and which would
    refuse to retry a run preempted after hours of training."""
    return m.RetryStrategy(
        limit=failure_retries + PREEMPTION_RETRIES,
        retry_policy="Always",  # Failed (an exit code) and Error (a pod deleted, evicted, never started) alike
        expression=argo_retry_expression(failure_retries),
        backoff=m.Backoff(duration="30s", factor=2, cap="10m"),
    )


def evaluate(settings: StepSettings, layout: Layout, resources: StepResources) -> Container:
    # --model-def: the workflow's model-def parameter, the network the weights are loaded into;
    # never the training run's own model_def parameter (a writer to MLflow can change that).
    args = ["evaluate", "--run-id", _param("run-id"), "--model-uri", _param("model-uri"), "--data", layout.dataset_in(),
            "--registered-model", _param("registered-model"), "--model-def", _param("model-def"), "--floor", _param("floor"),
            "--min-gain", _param("min-gain"), "--outputs", layout.outputs("evaluate")]
    inputs = _inputs(layout, ["run-id", "model-uri", "registered-model", "model-def", "floor", "min-gain"], True)
    return _container("evaluate", settings, layout, args, inputs,
                      _outputs(layout, "evaluate", ["blessed", "reason"], {"metrics": "metrics.json", "report": "report.md"}),
                      resources)


def export(settings: StepSettings, layout: Layout, resources: StepResources) -> Container:
    args = ["export", "--run-id", _param("run-id"), "--model-uri", _param("model-uri"), "--data", layout.dataset_in(),
            "--registered-model", _param("registered-model"), "--model-def", _param("model-def"),
            "--outputs", layout.outputs("export")]
    return _container("export", settings, layout, args,
                      _inputs(layout, ["run-id", "model-uri", "registered-model", "model-def"], True),
                      _outputs(layout, "export", ["model_version", "registered_model_uri"], {}), resources)


def promote(settings: StepSettings, layout: Layout, resources: StepResources) -> Container:
    args = ["promote", "--registered-model", _param("registered-model"), "--version", _param("version"),
            "--outputs", layout.outputs("promote")]
    return _container("promote", settings, layout, args, _inputs(layout, ["registered-model", "version"], False),
                      _outputs(layout, "promote", ["champion_version"], {}), resources)


DEPLOY_INPUTS = ["registered-model", "version", "target", "namespace", "service-account", "storage-secret"]


def deploy(settings: StepSettings, layout: Layout, resources: StepResources, service_account: str) -> Container:
    """The new champion served (elastic-step deploy): the exact version promote made champion,
    with canary and rollback; the server image is this one, fixed when the YAML is rendered.
    It runs as `service_account` (deploy/serving's elastic-step-deployer), not as the workflow's:
    the training steps' account has no rights on Deployments, Services or InferenceServices,
    and this one none on worker pods, job Secrets or NetworkPolicies."""
    args = ["deploy", *[a for name in DEPLOY_INPUTS for a in (f"--{name}", _param(name))], "--image", settings.image,
            "--outputs", layout.outputs("deploy")]
    return _container("deploy", settings, layout, args, _inputs(layout, DEPLOY_INPUTS, False),
                      _outputs(layout, "deploy", ["endpoint", "served_version"], {}), resources,
                      service_account=service_account)
