"""Training job settings, validated before anything starts. Their defaults are elastic_step.defaults'."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from elastic_step import defaults
from elastic_step.errors import ConfigError
from elastic_step.frameworks.device import DeviceChoice, Precision, parse_choice, parse_precision, place, visible_gpus
from elastic_step.protocol import LrScaling, TrainingMode


def parse_workers(text: str) -> tuple[int, int]:
    """`--workers MIN:MAX`, or one number for a fixed size."""
    try:
        low, _, high = str(text).partition(":")
        minimum, maximum = int(low), int(high or low)
    except ValueError:
        raise ConfigError(f"--workers {text!r} is not N or MIN:MAX (e.g. 3 or 2:4)") from None
    if minimum < 1:
        raise ConfigError(f"--workers {text!r}: the minimum must be at least 1")
    if minimum > maximum:
        raise ConfigError(f"--workers {text!r}: the minimum {minimum} is larger than the maximum {maximum}")
    return minimum, maximum


@dataclass
class TrainConfig:
    model_def: str
    data: str
    job_dir: str
    workers: str = defaults.WORKERS
    spares: int = defaults.SPARES  # warm workers beyond MAX that take a lost member's place at once
    epochs: int = defaults.EPOCHS
    minibatch_size: int = defaults.MINIBATCH_SIZE
    minibatches_per_task: int = defaults.MINIBATCHES_PER_TASK
    global_batch_size: int = defaults.GLOBAL_BATCH_SIZE  # rows per optimizer step whatever the group; 0: off
    lr_scaling: str = defaults.LR_SCALING  # none|linear|sqrt: the learning rate follows the step's rows
    device: str = defaults.DEVICE  # auto|cpu|cuda: where each worker computes
    precision: str = defaults.PRECISION  # fp32|bf16|fp16: what the forward pass computes in
    mode: str = defaults.MODE  # allreduce|ps: where the model's embedding tables live (protocol.TrainingMode)
    ps_shards: int = defaults.PS_SHARDS  # mode ps: parameter-server shard processes holding the tables
    ps_table_limit_mb: float = defaults.PS_TABLE_LIMIT_MB  # mode ps: beyond it, served from the shards' snapshots
    seed: int = defaults.SEED
    shuffle: bool = True
    audit: str | None = None
    backend: str = defaults.BACKEND
    host: str = defaults.HOST
    port: int = defaults.PORT
    max_relaunches: int = defaults.MAX_RELAUNCHES
    max_task_failures: int = defaults.MAX_TASK_FAILURES
    heartbeat_interval: float = defaults.HEARTBEAT_INTERVAL_S
    heartbeat_timeout: float = defaults.HEARTBEAT_TIMEOUT_S
    rendezvous_timeout: float = defaults.RENDEZVOUS_TIMEOUT_S
    startup_grace: float = defaults.STARTUP_GRACE_S
    collective_timeout: float = defaults.COLLECTIVE_TIMEOUT_S
    master_timeout: float = defaults.MASTER_TIMEOUT_S
    # SIGTERM to SIGKILL as the master's pod has it: the budget of a preemption's checkpoint and exit
    termination_grace: float = defaults.TERMINATION_GRACE_S
    job_name: str = ""  # default: the job folder's name
    progress: bool = True
    mlflow_uri: str | None = None  # default: MLFLOW_TRACKING_URI, else SQLite in the job dir
    experiment: str = defaults.EXPERIMENT
    parent_run_id: str | None = None
    pipeline_run_id: str = ""  # the pipeline run this step is a task of (a retried task resumes its run)
    checkpoint_steps: int = defaults.CHECKPOINT_STEPS
    keep_checkpoints: int = defaults.KEEP_CHECKPOINTS
    keep_best: str | None = None  # METRIC[:min|max]: also keep the best validated checkpoint
    resume: bool = False
    init_from: str | None = None
    worker_env: dict[str, str] = field(default_factory=dict)
    # --backend kubernetes (checked by elastic_step.backends.kubernetes.options)
    namespace: str | None = None
    image: str | None = None
    worker_cpu: str | None = None
    worker_memory: str | None = None
    worker_gpus: int = 0
    ps_cpu: str | None = None  # --mode ps: each shard pod's; None: a worker's
    ps_memory: str | None = None
    node_selector: list[str] = field(default_factory=list)
    tolerations: list[str] = field(default_factory=list)
    priority_class: str | None = None
    image_pull_secrets: list[str] = field(default_factory=list)
    service_account: str | None = None
    pending_timeout: float = defaults.PENDING_TIMEOUT_S
    master_network_policy: bool = True  # False: --no-master-network-policy, the explicit opt-out
    worker_store_secret: str | None = None  # the Secret worker pods read the data store with

    def __post_init__(self) -> None:
        self.min_workers, self.max_workers = parse_workers(self.workers)
        for name in ("epochs", "minibatch_size", "minibatches_per_task"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.spares < 0:
            raise ConfigError(f"--spares must be >= 0, got {self.spares}")
        if self.global_batch_size < 0:
            raise ConfigError(f"--global-batch-size must be >= 0 (0: each worker applies --minibatch-size rows per step), "
                              f"got {self.global_batch_size}")
        self.device, self.precision = parse_choice(self.device), parse_precision(self.precision)
        if self.device == DeviceChoice.CUDA and self.backend == "local":  # its workers see this machine's GPUs
            place(self.device, self.precision, gpus=visible_gpus())
        if self.lr_scaling not in {s.value for s in LrScaling}:
            raise ConfigError(f"--lr-scaling {self.lr_scaling!r} is not one of {', '.join(s.value for s in LrScaling)}")
        if self.lr_scaling != LrScaling.NONE and self.global_batch_size:
            raise ConfigError(f"--lr-scaling {self.lr_scaling} has nothing to scale with --global-batch-size "
                              f"{self.global_batch_size}: every step applies the same rows; drop one of the two")
        self._check_mode()
        for name in ("heartbeat_timeout", "rendezvous_timeout", "collective_timeout", "master_timeout", "termination_grace"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.keep_best is not None:
            from elastic_step.tracking.checkpoints import parse_best_rule

            try:
                parse_best_rule(self.keep_best)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        if self.checkpoint_steps < 0 or self.keep_checkpoints < 1:
            raise ConfigError("--checkpoint-steps must be >= 0 (0 turns checkpoints off) and --keep-checkpoints >= 1")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port {self.port} is not a TCP port (0 picks a free one)")
        self.job_dir = os.path.abspath(self.job_dir)
        if not self.job_name:
            self.job_name = os.path.basename(self.job_dir.rstrip("/")) or "elastic-step"
        if self.backend == "kubernetes":
            from elastic_step.backends.kubernetes.options import check_config

            check_config(self)

    def _check_mode(self) -> None:
        if self.mode not in {m.value for m in TrainingMode}:
            raise ConfigError(f"--mode {self.mode!r} is not one of {', '.join(m.value for m in TrainingMode)}")
        self.mode = TrainingMode(self.mode)
        if self.mode != TrainingMode.PS:
            return
        if not 1 <= self.ps_shards <= 128:
            raise ConfigError(f"--ps-shards must be between 1 and 128 (the virtual shards), got {self.ps_shards}")
        if not self.ps_table_limit_mb >= 0:
            raise ConfigError(f"--ps-table-limit-mb must be >= 0 (0: always serve the tables from the shards' snapshots), "
                              f"got {self.ps_table_limit_mb}")
        if self.global_batch_size:  # a push is keyed by its minibatch's rows: every minibatch is one task's
            raise ConfigError("--mode ps trains --minibatch-size rows per push; drop --global-batch-size")
        if self.precision == Precision.FP16:  # the loss scale covers the dense gradients, not the tables' pushes
            raise ConfigError("--mode ps with --precision fp16 is not offered: the embedding tables' pushes would carry "
                              "the loss scale; use --precision bf16 (no loss scale) or fp32")

    @property
    def rows_per_task(self) -> int:
        return self.minibatch_size * self.minibatches_per_task
