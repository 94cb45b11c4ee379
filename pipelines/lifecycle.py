"""The task graph both pipelines share: prepare → train → evaluate → if blessed: export → promote
(→ deploy the new champion, when the pipeline's serve_target asks for it).
The gate and export load the trained weights into the network of the pipeline's own `model_def`
parameter, the one train_elastic trained; never the training run's model_def in MLflow."""

from kfp import dsl, kubernetes
from kfp.dsl import Dataset, Input, Model

from elastic_step import defaults
from elastic_step.images import IMAGE_USER
from elastic_step.components import deploy_model, evaluate_model, export_model, prepare_data, promote_model, train_elastic

# A retried training task resumes its MLflow run from the newest checkpoint. KFP's retry cannot read
# exit codes: it retries every failed attempt alike (a preemption, exit 75, as a failure, and bad
# input, exit 2, too) and, with no retryPolicy in what it compiles to, not a pod that was deleted.
TRAIN_RETRIES = 2
# The downward API, as the Kubernetes backend reads it: the train task's process is the elastic
# master; its pod owns the worker pods, they go to its namespace and call it on its pod IP (it
# listens there, not on loopback).
MASTER_ENV = {"ELASTIC_STEP_POD_NAME": "metadata.name", "ELASTIC_STEP_POD_UID": "metadata.uid",
              "ELASTIC_STEP_POD_NAMESPACE": "metadata.namespace", "ELASTIC_STEP_POD_IP": "status.podIP"}
# The data store's keys, from KFP's own MinIO Secret (in every KFP namespace; keys accesskey /
# secretkey) when it exists: the master reads the dataset with them, and its worker pods get them
# by reference to the same Secret (never in a pod spec). Optional, so a cluster whose store needs
# no keys (workload identity, a public bucket) runs the pipeline as it is.
STORE_SECRET = "mlpipeline-minio-artifact"
STORE_SECRET_KEYS = {"accesskey": "AWS_ACCESS_KEY_ID", "secretkey": "AWS_SECRET_ACCESS_KEY"}
# Every task's pod carries both: the project's label, and the one deploy/mlflow's NetworkPolicy
# admits (step pods call MLflow; the train task's worker pods never carry it).
PART_OF = ("app.kubernetes.io/part-of", "elastic-step")
# MLflow's address and user come together from one Secret in the run's namespace, by reference, on
# every task that calls MLflow: the URI comes with the password, never from a parameter of the run
# (a task refuses a `mlflow_uri` other than the Secret's), and the Secret's name is fixed here, not
# chosen by whoever submits a run. Optional, for KFP's own MLflow integration, which sets these
# variables itself, and for an MLflow without auth named by `mlflow_uri`; a task left with no URI
# at all refuses in one line (exit 2).
MLFLOW_SECRET = defaults.MLFLOW_CREDENTIALS_SECRET
MLFLOW_SECRET_KEYS = {"uri": "MLFLOW_TRACKING_URI", "username": "MLFLOW_TRACKING_USERNAME",
                      "password": "MLFLOW_TRACKING_PASSWORD"}


def label_step(task):
    for key, value in (PART_OF, defaults.MLFLOW_CLIENT_LABEL):
        kubernetes.add_pod_label(task, key, value)


def uses_mlflow(task):
    kubernetes.use_secret_as_env(task, secret_name=MLFLOW_SECRET, secret_key_to_env=MLFLOW_SECRET_KEYS, optional=True)


def run_as_image_user(task):
    """PodSecurity `restricted` for the task's pod: the image's own non-root user. KFP 2.17's compiler
    adds the rest itself (no privilege escalation, every capability dropped, RuntimeDefault seccomp),
    which kfp-kubernetes cannot set and needs not."""
    kubernetes.set_security_context(task, run_as_user=IMAGE_USER, run_as_group=IMAGE_USER, run_as_non_root=True)


def as_elastic_master(task):
    for env_name, field_path in MASTER_ENV.items():
        kubernetes.use_field_path_as_env(task, env_name=env_name, field_path=field_path)
    kubernetes.add_pod_annotation(task, *defaults.ISTIO_MASTER_INBOUND)  # workers reach it in a mesh
    kubernetes.use_secret_as_env(task, secret_name=STORE_SECRET, secret_key_to_env=STORE_SECRET_KEYS, optional=True)
    return task


def lifecycle_pipeline(name: str, description: str, warm_start_alias: str, caching: bool):
    """One pipeline of the lifecycle. Both ready pipelines come from here so their parameters
    (what a user sets in the KFP UI) are declared once and cannot drift apart; their defaults
    are elastic_step.defaults'."""

    @dsl.pipeline(name=name, description=description)
    def pipeline(
        source: str = defaults.SOURCE,
        label: str = defaults.LABEL,
        model_def: str = defaults.MODEL_DEF,
        registered_model: str = defaults.REGISTERED_MODEL,
        workers: str = defaults.WORKERS,
        spares: int = defaults.SPARES,
        epochs: int = defaults.EPOCHS,
        minibatch_size: int = defaults.MINIBATCH_SIZE,
        minibatches_per_task: int = defaults.MINIBATCHES_PER_TASK,
        global_batch_size: int = defaults.GLOBAL_BATCH_SIZE,
        lr_scaling: str = defaults.LR_SCALING,
        mode: str = defaults.MODE,
        ps_shards: int = defaults.PS_SHARDS,
        ps_table_limit_mb: float = defaults.PS_TABLE_LIMIT_MB,
        checkpoint_steps: int = defaults.CHECKPOINT_STEPS,
        backend: str = defaults.BACKEND,
        device: str = defaults.DEVICE,
        precision: str = defaults.PRECISION,
        mlflow_uri: str = "",
        experiment: str = defaults.EXPERIMENT,
        floors: dict = dict(defaults.FLOORS),
        min_gains: dict = dict(defaults.MIN_GAINS),
        split: str = defaults.SPLIT,
        categorical: str = "",
        rows_per_shard: int = defaults.ROWS_PER_SHARD,
        seed: int = defaults.SEED,
        job_dir: str = "",
        serve_target: str = "",
        serve_namespace: str = "",
        serve_service_account: str = "",
        serve_storage_secret: str = "",
    ):
        # categorical: the string columns' ids (prepare_data's spec, or auto), as a mode=ps model's tables take them
        # The dataset's manifest records its label column: evaluate and export read it from there.
        prepared = prepare_data(source=source, label=label, split=split, rows_per_shard=rows_per_shard, seed=seed,
                                categorical=categorical)
        trained = train_elastic(
            dataset=prepared.outputs["dataset"], model_def=model_def, workers=workers, spares=spares, epochs=epochs,
            minibatch_size=minibatch_size, minibatches_per_task=minibatches_per_task,
            global_batch_size=global_batch_size, lr_scaling=lr_scaling, mode=mode, ps_shards=ps_shards,
            ps_table_limit_mb=ps_table_limit_mb,
            checkpoint_steps=checkpoint_steps, seed=seed, backend=backend, device=device, precision=precision,
            mlflow_uri=mlflow_uri, experiment=experiment,
            registered_model=registered_model, warm_start_alias=warm_start_alias,
            pipeline_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, job_dir=job_dir,
        )
        trained.set_retry(num_retries=TRAIN_RETRIES, backoff_duration="30s", backoff_factor=2.0)
        as_elastic_master(trained)
        judged = evaluate_model(
            candidate=trained.outputs["model"], dataset=prepared.outputs["dataset"], registered_model=registered_model,
            model_def=model_def, floors=floors, min_gains=min_gains, mlflow_uri=mlflow_uri,
        )
        released = (release_if_blessed if caching else release_if_blessed_uncached)(
            blessed=judged.outputs["blessed"], candidate=trained.outputs["model"], dataset=prepared.outputs["dataset"],
            registered_model=registered_model, model_def=model_def, mlflow_uri=mlflow_uri,
            serve_target=serve_target, serve_namespace=serve_namespace, serve_service_account=serve_service_account,
            serve_storage_secret=serve_storage_secret,
        )
        for task in (prepared, trained, judged):
            label_step(task)
            run_as_image_user(task)
        for task in (trained, judged):
            uses_mlflow(task)
        for task in (prepared, trained, judged, released):
            task.set_caching_options(caching)

    return pipeline


def _release_if_blessed(caching: bool):
    """export → promote (→ deploy the new champion when `serve_target` is kserve or mlflow),
    only when the gate blessed the candidate. A sub-pipeline so that the
    condition reads a plain input of its own (`blessed`): KFP's local runner cannot resolve a
    condition on a named output of a sibling task, and the graph is the same on a cluster."""

    @dsl.pipeline(name="release-if-blessed" if caching else "release-if-blessed-uncached")
    def release(blessed: bool, candidate: Input[Model], dataset: Input[Dataset], registered_model: str, model_def: str,
                mlflow_uri: str, serve_target: str, serve_namespace: str, serve_service_account: str,
                serve_storage_secret: str):
        with dsl.If(blessed == True, name="blessed"):  # noqa: E712 (a KFP condition, not Python)
            exported = export_model(candidate=candidate, dataset=dataset, registered_model=registered_model,
                                    model_def=model_def, mlflow_uri=mlflow_uri,
                                    pipeline_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER)
            promoted = promote_model(registered_model=registered_model, version=exported.outputs["model_version"],
                                     mlflow_uri=mlflow_uri)
            for task in (exported, promoted):
                label_step(task)
                run_as_image_user(task)
                uses_mlflow(task)
                task.set_caching_options(caching)
            with dsl.If(serve_target != "", name="serve"):  # "" (the default): promote only
                deployed = deploy_model(registered_model=registered_model, version=promoted.outputs["champion_version"],
                                        target=serve_target, namespace=serve_namespace,
                                        service_account=serve_service_account, storage_secret=serve_storage_secret,
                                        mlflow_uri=mlflow_uri)
                label_step(deployed)
                run_as_image_user(deployed)
                uses_mlflow(deployed)
                deployed.set_caching_options(False)  # a deploy acts on the cluster as it is now

    return release


# Defined here, at import time: KFP does not allow defining a pipeline inside another's body.
release_if_blessed = _release_if_blessed(caching=True)
release_if_blessed_uncached = _release_if_blessed(caching=False)
