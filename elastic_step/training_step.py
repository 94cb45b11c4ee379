"""The training step as a pipeline runs it (the KFP component is a shell over this): resolve the
warm start, tag the run with the pipeline run so a retried task resumes it, train, and put the
model where the pipeline's artifact store picks it up."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass

from elastic_step import defaults
from elastic_step.config import TrainConfig
from elastic_step.data import stores
from elastic_step.master.job import JobResult, run_job


@dataclass
class TrainStepResult:
    job: JobResult
    framework: str
    init_from: str

    @property
    def test_metrics(self) -> dict:
        return {k: float(v) for k, v in self.job.test_metrics.items() if k != "rows"}

    @property
    def history_metrics(self) -> dict:
        """The job's restart and recovery history, for a pipeline's Metrics output beside the
        test metrics: what a person compares across runs of a schedule."""
        recoveries = self.job.recoveries_s
        return {"relaunches": float(self.job.relaunches), "regroups": float(self.job.regroups),
                "recoveries": float(len(recoveries)), "recovery_s_max": float(max(recoveries, default=0.0))}

    def report_html(self) -> str:
        """The job's report (loss, samples/s, world size over time, worker timeline, recoveries)
        as one self-contained HTML page: the KFP UI renders an HTML artifact, not TensorBoard."""
        from elastic_step.tracking.report_html import render_report

        return render_report(self.job.job_dir)

    def model_metadata(self) -> dict:
        return {"mlflow_run_id": self.job.run_id, "model_uri": self.job.model_uri, "mlflow_uri": self.job.mlflow_uri,
                "framework": self.framework, "steps": self.job.steps, "init_from": self.init_from}


def warm_start_source(registered_model: str, alias: str, mlflow_uri: str | None) -> str:
    """`models:/NAME@ALIAS` when that alias exists; "" (train cold) when the model has no such
    version yet — the first scheduled retrain of a new model has no champion to start from."""
    from elastic_step.release.registry import registry_client, version_by_alias

    if not (registered_model and alias):
        return ""
    if version_by_alias(registry_client(mlflow_uri), registered_model, alias) is None:
        print(f"{registered_model} has no @{alias} yet; training from scratch", file=sys.stderr)
        return ""
    return f"models:/{registered_model}@{alias}"


def train_step(*, data: str, model_dir: str, model_def: str = defaults.MODEL_DEF, workers: str = defaults.WORKERS,
               spares: int = defaults.SPARES, epochs: int = defaults.EPOCHS, minibatch_size: int = defaults.MINIBATCH_SIZE,
               minibatches_per_task: int = defaults.MINIBATCHES_PER_TASK,
               global_batch_size: int = defaults.GLOBAL_BATCH_SIZE, lr_scaling: str = defaults.LR_SCALING,
               mode: str = defaults.MODE, ps_shards: int = defaults.PS_SHARDS,
               ps_table_limit_mb: float = defaults.PS_TABLE_LIMIT_MB, checkpoint_steps: int = defaults.CHECKPOINT_STEPS,
               seed: int = defaults.SEED, backend: str = defaults.BACKEND, mlflow_uri: str = "",
               experiment: str = defaults.EXPERIMENT, init_from: str = "", registered_model: str = "",
               warm_start_alias: str = "", pipeline_run_id: str = "", job_dir: str = "", job_name: str = "train-elastic",
               storage_options: dict | None = None, priority_class: str = "", device: str = defaults.DEVICE,
               precision: str = defaults.PRECISION, worker_cpu: str = "", worker_memory: str = "", worker_gpus: int = 0,
               ps_cpu: str = "", ps_memory: str = "", image: str = "", worker_service_account: str = "",
               node_selector: dict | str | None = None,
               tolerations: list | str | None = None) -> TrainStepResult:
    """`storage_options`: fsspec options for `data`'s store (e.g. the endpoint of KFP's MinIO), applied
    here and handed to the workers. The worker pods' settings (`backend=kubernetes`; "" or empty: train's
    defaults) are checked with the job's: bad ones fail before anything starts. `node_selector` and
    `tolerations` come as KFP hands them over (a dict, a list, or their JSON: elastic_step.placement)."""
    from elastic_step.placement import node_selector_items, toleration_items

    selector, toleration = node_selector_items(node_selector), toleration_items(tolerations)  # refused before anything starts
    if storage_options:
        stores.set_storage_options(data, storage_options)
    init_from = init_from or warm_start_source(registered_model, warm_start_alias, mlflow_uri or None)
    job_dir = job_dir or tempfile.mkdtemp(prefix="elastic-step-job-")
    config = TrainConfig(
        model_def=model_def, data=data, job_dir=job_dir, job_name=job_name,
        audit=os.path.join(job_dir, "audit.jsonl"),  # so anyone can check exactly-once afterwards
        workers=workers, spares=spares, epochs=epochs, minibatch_size=minibatch_size,
        minibatches_per_task=minibatches_per_task, global_batch_size=global_batch_size, lr_scaling=lr_scaling,
        mode=mode, ps_shards=ps_shards,  # ps: the tables on shard processes beside the workers (local backend)
        ps_table_limit_mb=ps_table_limit_mb,  # ps: larger tables are served from the shards' snapshots
        checkpoint_steps=checkpoint_steps, seed=seed, backend=backend,
        mlflow_uri=mlflow_uri or None, experiment=experiment, init_from=init_from or None,
        progress=True,  # in a pipeline's pod (no terminal) a plain line every few seconds in the step's log
        pipeline_run_id=pipeline_run_id,  # a retried task finds and resumes its run by it
        worker_env=stores.worker_env(),  # the store's location and options for the workers (never credentials)
        priority_class=priority_class or None,  # the worker pods'
        device=device, precision=precision, worker_cpu=worker_cpu or None, worker_memory=worker_memory or None,
        worker_gpus=worker_gpus, ps_cpu=ps_cpu or None, ps_memory=ps_memory or None,  # the shard pods' (mode ps)
        image=image or None, service_account=worker_service_account or None,
        node_selector=selector, tolerations=toleration,
    )
    job = run_job(config)
    shutil.copytree(job.model_dir, model_dir, dirs_exist_ok=True)  # where the pipeline's artifact store looks
    with open(os.path.join(job.model_dir, "model.json")) as f:
        framework = json.load(f)["framework"]
    return TrainStepResult(job, framework, init_from)
