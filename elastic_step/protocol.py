"""The master's HTTP+JSON protocol: the only thing master and worker share."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

API = "/v1"


class RegisterRequest(BaseModel):
    worker_id: str = Field(min_length=1, max_length=128)
    pid: int = 0
    host: str = ""


class JobSpec(BaseModel):
    """What a worker needs to know about the job, handed out at registration."""

    job_name: str
    model_def: str
    manifest: str
    minibatch_size: int
    seed: int
    store_host: str
    store_port: int
    collective_timeout_s: float
    heartbeat_interval_s: float
    master_timeout_s: float
    features: list[str]
    label: str
    checkpoint_steps: int = 0  # rank 0 checkpoints every K steps and at each epoch end; 0: never


class HeartbeatRequest(BaseModel):
    worker_id: str
    round_id: int = 0
    step: int = -1


class HeartbeatReply(BaseModel):
    round_id: int
    acked_step: int
    action: Literal["continue", "stop"]


class RangeRecord(BaseModel):
    task_id: int = Field(ge=0)
    offset: int = Field(ge=0)
    count: int = Field(gt=0)


class StepRecord(BaseModel):
    step: int = Field(ge=1)
    ranges: list[RangeRecord | None]  # by rank; None where that rank had no data
    samples: int = Field(ge=0)
    loss: float
    time: float
    checkpoint: bool = False  # rank 0 snapshotted its state after this step


class RendezvousRequest(BaseModel):
    worker_id: str
    step: int = Field(ge=-1)
    unacked: list[StepRecord] = []
    left_round: int = 0  # the round this worker just left (0: none)


class RendezvousReply(BaseModel):
    status: Literal["ready", "wait", "stop", "done"]
    round_id: int = 0
    rank: int = 0
    world_size: int = 0
    store_prefix: str = ""
    source_rank: int = 0
    start_step: int = 0
    acked_step: int = 0
    initial_state: Literal["", "checkpoint", "model"] = ""  # the source loads it from the master first


class TaskRequest(BaseModel):
    worker_id: str
    round_id: int


class TaskInfo(BaseModel):
    id: int
    epoch: int
    shard: int
    start: int
    count: int


class TaskReply(BaseModel):
    status: Literal["task", "wait", "done", "regroup"]
    task: TaskInfo | None = None


class TaskFailedRequest(BaseModel):
    worker_id: str
    task_id: int
    error: str = Field(max_length=4000)


class StepsRequest(BaseModel):
    worker_id: str
    round_id: int
    steps: list[StepRecord]


class StepsReply(BaseModel):
    acked_step: int
    epoch: int = 0  # the epoch in progress (rank 0 checkpoints when it moves on)


class CollectiveFailedRequest(BaseModel):
    worker_id: str
    round_id: int
    error: str = Field(default="", max_length=4000)


class FailJobRequest(BaseModel):
    worker_id: str
    reason: str = Field(max_length=4000)


class ScaleRequest(BaseModel):
    workers: int = Field(ge=1)
