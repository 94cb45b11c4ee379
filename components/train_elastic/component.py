from kfp import dsl
from kfp.dsl import HTML, Dataset, Input, Metrics, Model, Output

from elastic_step.images import default_image


# The defaults below are elastic_step.defaults' (KFP runs this function's source alone in its
# container, so they cannot be imported here; tests/test_defaults.py keeps them equal).
@dsl.component(base_image=default_image(), install_kfp_package=False)
def train_elastic(
    dataset: Input[Dataset],
    model: Output[Model],
    metrics: Output[Metrics],
    report: Output[HTML],
    model_def: str = "elastic_step.model_zoo.digits_torch",
    workers: str = "2:3",
    spares: int = 0,
    epochs: int = 5,
    minibatch_size: int = 32,
    minibatches_per_task: int = 4,
    global_batch_size: int = 0,
    lr_scaling: str = "none",
    mode: str = "allreduce",
    ps_shards: int = 2,
    ps_table_limit_mb: float = 2048.0,
    checkpoint_steps: int = 100,
    seed: int = 0,
    backend: str = "local",
    mlflow_uri: str = "",
    experiment: str = "elastic-step",
    init_from: str = "",
    registered_model: str = "",
    warm_start_alias: str = "",
    pipeline_run_id: str = "",
    job_dir: str = "",
    priority_class: str = "",
    device: str = "auto",
    precision: str = "fp32",
    worker_cpu: str = "",
    worker_memory: str = "",
    worker_gpus: int = 0,
    ps_cpu: str = "",
    ps_memory: str = "",
    image: str = "",
    worker_service_account: str = "",
    node_selector: dict = {},
    tolerations: list = [],
):
    """Train with an elastic group of workers; this step's process is the elastic master.

    Workers run as local processes (`backend=local`) or pods (`backend=kubernetes`); a worker
    that dies is dropped and training goes on without restarting the others, and every row of
    every epoch is applied exactly once. A retry of this task resumes its own MLflow run from
    the newest committed checkpoint. On SIGTERM (the task's pod evicted or preempted) the step
    checkpoints its next step, marks the run preempted and exits 75 within the pod's grace period;
    bad input exits 2 (elastic_step.exit_codes).

    Where workers read the data: local workers read the copy KFP downloaded to the dataset's
    `.path`. Worker pods (`backend=kubernetes`) read the dataset's URI straight from the store:
    KFP's `minio://bucket/key` is read as `s3://bucket/key`, and `s3://` and `gs://` as they are.
    On a cluster that needs, in this step's environment: the store endpoint `AWS_ENDPOINT_URL`
    (unset: KFP's default MinIO service `http://minio-service.kubeflow:9000`) and `AWS_REGION`
    where the store wants one, which the step hands on to its worker pods; `AWS_ACCESS_KEY_ID`
    and `AWS_SECRET_ACCESS_KEY` from a Kubernetes Secret (e.g. `kubernetes.use_secret_as_env` on
    KFP's `mlpipeline-minio-artifact` Secret, keys `accesskey`/`secretkey`), which worker pods
    need from a Secret too (credentials never travel in a pod spec); for GCS,
    `GOOGLE_APPLICATION_CREDENTIALS` or workload identity. Never pass credentials as parameters.

    Args:
        dataset: Prepared data from prepare_data (its URI is what worker pods open).
        model: The trained model; metadata: MLflow run id, model URI, framework.
        metrics: Test-split metrics of the trained model, and the job's history: relaunches,
            regroups (rounds formed, the first included), recoveries and the longest in seconds.
        report: The job's report as a page (loss, samples/s and world size over time, each
            worker slot's attempts with their exit causes, recoveries), shown by the KFP UI.
        model_def: The model definition: a module name or a .py file.
        workers: N, or MIN:MAX for an elastic group.
        spares: Warm workers beyond MAX that wait and take a lost member's rank at once.
        epochs: Passes over the train split.
        minibatch_size: Rows per minibatch per worker.
        minibatches_per_task: Minibatches in each task the master hands out.
        global_batch_size: Rows in every optimizer step whatever the number of live workers
            (each computes its share in minibatches of at most minibatch_size), so results do not
            depend on failures; 0 (the default): minibatch_size rows per worker per step.
        lr_scaling: Without global_batch_size: `linear` or `sqrt` scales the model definition's
            learning rate by a step's rows over a full group's (minibatch_size x MAX); `none`.
        mode: `allreduce` (every worker holds the whole model) or `ps`: the model's embedding tables
            (`PsEmbedding`, PyTorch's or Keras', e.g. `elastic_step.model_zoo.deepfm_ps_torch` or
            `deepfm_ps_keras`) on `ps_shards` parameter-server shards this step starts beside its
            workers (processes in its pod, or pods with `backend=kubernetes`), each row updated once
            per minibatch. `ps` needs no `global_batch_size`.
        ps_shards: With `mode=ps`: the shard processes holding the tables (1 to 128).
        ps_table_limit_mb: With `mode=ps`: tables (ids and weights) up to this size are held whole
            and logged with the model; larger ones are logged as the shards' snapshots with an MLflow
            pyfunc model that serves from them (which export refuses, naming the pyfunc).
        checkpoint_steps: Checkpoint every K steps and at each epoch end (0: never).
        seed: Seed of the model's initialisation and of the per-epoch shuffle.
        backend: Where workers run: `local` or `kubernetes`.
        mlflow_uri: Tracking URI (default: MLFLOW_TRACKING_URI).
        experiment: MLflow experiment.
        init_from: Warm start from `models:/NAME@ALIAS`, a model URI or a run id.
        registered_model: With warm_start_alias: warm start from `models:/<registered_model>@<alias>`.
        warm_start_alias: The alias to warm start from (e.g. `champion`); with none yet, training starts cold.
        pipeline_run_id: The pipeline run (tags the MLflow run so a retried task finds it).
        job_dir: Folder for the job's state and logs (default: a fresh temporary folder).
        priority_class: PriorityClass of the worker pods (`backend=kubernetes`; "" for the cluster's
            default). The task's own pod, the master, gets its priority from the namespace's or the
            cluster's default: KFP has no setting for a task pod's priority class.
        device: Where each worker computes: `auto` (its GPU where it sees one, else the CPU), `cpu`,
            or `cuda` (refused at the worker's pre-flight where no GPU is visible).
        precision: The forward pass in `fp32`, or under `bf16` or `fp16` autocast (fp16's loss
            scale computes an overflowed pass again rather than skip its rows; PyTorch models
            only). Recorded in MLflow.
        worker_cpu: CPU of each worker pod, REQUEST or REQUEST:LIMIT (e.g. `2`, `500m:2`; "": none).
        worker_memory: Memory of each worker pod, REQUEST or REQUEST:LIMIT (e.g. `4Gi`; "": none).
        worker_gpus: `nvidia.com/gpu` of each worker pod (the cluster needs NVIDIA's device plugin).
        ps_cpu: With `mode=ps` and `backend=kubernetes`: CPU of each parameter-server shard pod,
            REQUEST or REQUEST:LIMIT ("": a worker pod's).
        ps_memory: With `mode=ps` and `backend=kubernetes`: memory of each shard pod, REQUEST or
            REQUEST:LIMIT (e.g. `8Gi`: a shard holds its part of the tables in memory; "": a worker pod's).
        image: The worker pods' image ("": this task's own image).
        worker_service_account: The worker pods' service account ("": `elastic-step-worker` from
            deploy/workers, which has no Role and mounts no token); never this task's own.
        node_selector: Node labels each worker pod must match, e.g.
            `{"cloud.google.com/gke-accelerator": "nvidia-l4"}` (a dict, or its JSON text in the KFP UI).
            For this task's own pod, use `kfp.kubernetes.add_node_selector` on the task
            (`elastic_step.components.train_elastic.placement.place_task` takes the same values).
        tolerations: Taints each worker pod tolerates: Kubernetes tolerations, e.g.
            `[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]`, or
            `KEY[=VALUE][:EFFECT]` strings. For this task's own pod: `kfp.kubernetes.add_toleration`.
    """
    import sys

    from elastic_step.data.stores import artifact_data_uri
    from elastic_step.errors import ElasticStepError
    from elastic_step.training_step import train_step

    data, storage_options = artifact_data_uri(dataset.uri, dataset.path, workers_share_filesystem=backend == "local")
    try:
        result = train_step(
            data=data, storage_options=storage_options, model_dir=model.path, model_def=model_def, workers=workers,
            spares=spares, epochs=epochs, minibatch_size=minibatch_size, minibatches_per_task=minibatches_per_task,
            global_batch_size=global_batch_size, lr_scaling=lr_scaling, mode=mode, ps_shards=ps_shards,
            ps_table_limit_mb=ps_table_limit_mb, checkpoint_steps=checkpoint_steps, seed=seed,
            backend=backend, mlflow_uri=mlflow_uri, experiment=experiment, init_from=init_from,
            registered_model=registered_model, warm_start_alias=warm_start_alias, pipeline_run_id=pipeline_run_id,
            job_dir=job_dir, priority_class=priority_class, device=device, precision=precision, worker_cpu=worker_cpu,
            worker_memory=worker_memory, worker_gpus=worker_gpus, ps_cpu=ps_cpu, ps_memory=ps_memory, image=image,
            worker_service_account=worker_service_account, node_selector=node_selector, tolerations=tolerations,
        )
    except ElasticStepError as exc:  # one line, and the exit code of the table (75: preempted, 2: bad input)
        print(f"train_elastic: {exc}", file=sys.stderr)
        raise SystemExit(int(exc.exit_code)) from None
    model.metadata.update(result.model_metadata())
    for name, value in {**result.test_metrics, **result.history_metrics}.items():
        metrics.log_metric(name, value)
    with open(report.path, "w") as f:
        f.write(result.report_html())
