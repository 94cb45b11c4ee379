"""Training job settings, validated before anything starts."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from elastic_step.errors import ConfigError


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
    workers: str = "2"
    epochs: int = 1
    minibatch_size: int = 32
    minibatches_per_task: int = 4
    seed: int = 0
    shuffle: bool = True
    audit: str | None = None
    backend: str = "local"
    host: str = "127.0.0.1"
    port: int = 0
    max_relaunches: int = 3
    max_task_failures: int = 3
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 10.0
    rendezvous_timeout: float = 60.0
    startup_grace: float = 60.0
    collective_timeout: float = 30.0
    master_timeout: float = 30.0
    job_name: str = ""
    progress: bool = True
    mlflow_uri: str | None = None  # default: MLFLOW_TRACKING_URI, else SQLite in the job dir
    experiment: str = "elastic-step"
    parent_run_id: str | None = None
    checkpoint_steps: int = 100
    keep_checkpoints: int = 3
    resume: bool = False
    init_from: str | None = None
    worker_env: dict[str, str] = field(default_factory=dict)
    # --backend kubernetes (checked by elastic_step.backends.kubernetes.options)
    namespace: str | None = None
    image: str | None = None
    worker_cpu: str | None = None
    worker_memory: str | None = None
    worker_gpus: int = 0
    node_selector: list[str] = field(default_factory=list)
    tolerations: list[str] = field(default_factory=list)
    priority_class: str | None = None
    image_pull_secrets: list[str] = field(default_factory=list)
    service_account: str | None = None
    pending_timeout: float = 300.0

    def __post_init__(self) -> None:
        self.min_workers, self.max_workers = parse_workers(self.workers)
        for name in ("epochs", "minibatch_size", "minibatches_per_task"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("heartbeat_timeout", "rendezvous_timeout", "collective_timeout", "master_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
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

    @property
    def rows_per_task(self) -> int:
        return self.minibatch_size * self.minibatches_per_task
