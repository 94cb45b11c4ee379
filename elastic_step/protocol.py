"""The master's HTTP+JSON protocol: the only thing master and worker share.

Requests are strict: a field of the wrong type (a string where a number belongs, a float where
an integer does), a field the model does not name, a count out of range or a list longer than
any real job sends is refused with 422 before the master looks at it. The OpenAPI document the
master serves is generated from these models, so it is the contract as the master enforces it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

API = "/v1"


class Route(StrEnum):
    """Every route of the master's API, under API. The master serves exactly these."""

    REGISTER = "/register"  # a launched worker says it has started: JobSpec back
    HEARTBEAT = "/heartbeat"  # every worker, every heartbeat_interval_s
    RENDEZVOUS = "/rendezvous"  # join the next round (long poll)
    TASK = "/task"  # the next row range to train on
    TASK_FAILED = "/task-failed"  # a task's rows could not be read or fed
    STEPS = "/steps"  # rank 0 reports applied steps
    COLLECTIVE_FAILED = "/collective-failed"  # a round's collective failed on this worker
    FAIL = "/fail"  # a member fails the job (a non-finite loss)
    PREFLIGHT_FAILED = "/preflight-failed"  # a launched worker cannot import the model or read the data
    MODEL = "/model"  # rank 0 hands in the final model (PUT, bytes)
    CHECKPOINT = "/checkpoint"  # rank 0's state for a checkpoint step (PUT, bytes)
    INITIAL_STATE = "/initial-state"  # the checkpoint or model the first round's source loads
    SCALE = "/scale"  # the operator changes the number of workers
    STATUS = "/status"  # the job as people and the CLI see it
    EVENTS = "/events"  # membership events from an index on (read-only: `get -e`, the live page)
    HISTORY = "/history"  # loss, samples/s and world size over time (read-only: the live page)
    STOP = "/stop"  # the operator stops the job after a final checkpoint (resumable)
    SCALE_PS = "/scale-ps"  # the operator changes the number of parameter-server shards (--mode ps)


# The live status page, outside API: a page without data. Its script reads the read-only token
# from the address's fragment (never sent to the server) and calls the read-only routes with it.
UI_PAGE = "/ui"
# Routes the read-only (view) token may call; every other route needs the job token.
READ_ONLY_ROUTES = (Route.STATUS, Route.EVENTS, Route.HISTORY)

# Bounds: generous for any real job, small enough that no request can make the master build a
# huge list or hold a number it cannot store.
MAX_INT = 2**53  # ids, counts and steps stay exact in every JSON reader
MAX_WORLD = 4096  # ranks in one round
MAX_STEPS_PER_REQUEST = 100_000  # steps in one report or one rendezvous' unacknowledged list


def _whole_number(value):
    """JSON Schema counts 3.0 as an integer, so the master takes it as 3; a fraction, a string
    or a boolean where an integer belongs stays an error."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_whole_number)]

# w<slot>.<attempt> for the master's own workers; any short id of these characters is
# well-formed (and then refused unless the master launched a worker of that id).
WorkerId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
Count = Annotated[int, Field(ge=0, le=MAX_INT), BeforeValidator(_whole_number)]  # Field first: its bounds reach the schema
RoundId = Annotated[int, Field(ge=0, le=MAX_INT), BeforeValidator(_whole_number)]
Message = Annotated[str, Field(max_length=4000)]


class JobState(StrEnum):
    """A job's state, as /status reports it. RUNNING -> SUCCEEDED once rank 0 hands in the final
    model at the step that applies the last row; RUNNING -> FAILED on any unrecoverable error
    (the failure says what to do); RUNNING -> STOPPED when the operator stopped it and its final
    checkpoint is handed over (`train --resume` continues it); RUNNING -> PREEMPTED when the
    master got SIGTERM and its checkpoint of the next step is handed over, or its grace period's
    first half passed without one (the same command continues it). All four ends are final."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"  # by the operator (`elastic-step stop`), after a final committed checkpoint
    PREEMPTED = "preempted"  # SIGTERM to the master (eviction, drain, preemption): checkpointed and yielded


class WorkerState(StrEnum):
    """A worker as the master sees it:

        LAUNCHED --register--> LIVE --scaled in--> RETIRING
           |                    |                     |
           +--------------------+---- exit ----------> GONE

    A GONE worker is never back: its slot is relaunched under a new id."""

    LAUNCHED = "launched"  # started by the backend, not yet registered
    LIVE = "live"  # registered, heartbeating; a member of rounds once it called in to rendezvous
    RETIRING = "retiring"  # scaled in: it finishes its round and leaves
    GONE = "gone"  # exited, or dropped and killed


class PsShardState(StrEnum):
    """A `--mode ps` job's parameter-server shard as its master sees it:
    SERVING --exits--> RELAUNCHING --ready--> SERVING; RELAUNCHING --3 failed tries--> DOWN."""

    SERVING = "serving"  # its process answers on its address
    RELAUNCHING = "relaunching"  # died; restarting on the same port from its snapshot and ledger
    DOWN = "down"  # could not come back: the workers' pushes to it fail the job


class RoundState(StrEnum):
    """A round as the master sees it:

        GATHERING --every member called in to rendezvous, the settle chose its start--> READY

    A READY round stays ready until a newer round replaces it (a death, a join, a leave, a
    scale); a GATHERING round that a member misses is replaced too."""

    GATHERING = "gathering"  # proposed: its members are asked to rendezvous
    READY = "ready"  # settled: members have their ranks, start step and state source


class EventKind(StrEnum):
    """Every kind of event the master records (events.jsonl, /events, MLflow, `get -e`)."""

    LAUNCHED = "launched"  # a slot's worker was started (attempt 1, or a relaunch)
    JOINED = "joined"  # a worker registered
    READY = "ready"  # a round was settled
    ROUND_PROPOSED = "round_proposed"
    REGROUPED = "regrouped"  # a new round replaced a ready one
    RECOVERED = "recovered"  # the first step after a regroup: its seconds since the cause
    DIED = "died"  # a worker's process or pod ended
    DROPPED = "dropped"  # a live but useless worker (hung, absent at rendezvous) was killed
    RELAUNCHED = "relaunched"
    NOT_RELAUNCHED = "not_relaunched"  # its exit says a relaunch would fail again
    SLOT_EXHAUSTED = "slot_exhausted"  # a slot used its --max-relaunches
    LEFT = "left"  # a worker retired by scaling in, or left on SIGTERM (an eviction): not a failure
    SCALED = "scaled"
    PS_SCALE_STARTED = "ps_scale_started"  # scale --ps began moving virtual shards (shards_from, shards_to)
    PS_SCALE_FINISHED = "ps_scale_finished"  # ... and ended: ok, rows_moved of rows_total, pause_max_s, seconds
    TASK_FAILED = "task_failed"  # a task's rows could not be read
    COLLECTIVE_FAILED = "collective_failed"
    CHECKPOINT = "checkpoint"  # a checkpoint was handed over
    RESTORED = "restored"  # every worker holding the model died: the group goes on from the master's newest checkpoint
    MASTER_PAUSED = "master_paused"  # the master itself did not tick for a while: silence forgiven
    STOP_REQUESTED = "stop_requested"
    STOPPED = "stopped"
    PREEMPTED = "preempted"  # the master got SIGTERM and yielded (after a checkpoint, when there was time)
    JOB_SUCCEEDED = "job_succeeded"
    JOB_FAILED = "job_failed"


class WorkerEnv(StrEnum):
    """The environment every worker is launched with (a process's, or a pod's spec)."""

    MASTER_URL = "ELASTIC_STEP_MASTER_URL"  # where the master's API is
    TOKEN_FILE = "ELASTIC_STEP_TOKEN_FILE"  # the file holding the job token (never the token itself)
    WORKER_ID = "ELASTIC_STEP_WORKER_ID"  # its id, w<slot>.<attempt>
    COLLECTIVE_BACKEND = "ELASTIC_STEP_COLLECTIVE_BACKEND"  # nccl on GPU pods; gloo otherwise


# The exit code of a worker that left on SIGTERM (its pod evicted or preempted, its node
# drained, a person's `kill`): 128 + SIGTERM, what a container runtime reports for a process that
# SIGTERM ended, so a worker that left through its handler and one the signal ended read alike.
# The master counts it as a departure, not a failure: no relaunch is charged against the slot.
WORKER_LEFT_EXIT_CODE = 143


class Rendezvous(StrEnum):
    """The rendezvous reply's status."""

    READY = "ready"  # the round is settled: join it with this rank and store prefix
    WAIT = "wait"  # no round for this worker yet: call again
    STOP = "stop"  # this worker is not (or no longer) wanted: exit
    DONE = "done"  # the job has succeeded: exit


class TaskStatus(StrEnum):
    """The task reply's status."""

    TASK = "task"  # here is a task
    WAIT = "wait"  # the epoch's last tasks are in flight: step without data, ask again
    DONE = "done"  # every row of every epoch is applied
    REGROUP = "regroup"  # the asker's round is over: rendezvous again


class LrScaling(StrEnum):
    """How workers scale the model definition's learning rate by the rows a step applies, for
    jobs that keep the per-worker batch (no --global-batch-size): the rate stays fitted to the
    batch it was chosen for, the full group's (--minibatch-size x MAX workers)."""

    NONE = "none"  # the model definition's rate, whatever the group's size
    LINEAR = "linear"  # rate x B / B_full (Goyal et al. 2017): plain SGD and momentum
    SQRT = "sqrt"  # rate x sqrt(B / B_full): adaptive optimizers (Adam and kin)

    def factor(self, samples: int, full_batch: int) -> float:
        ratio = samples / full_batch
        return {LrScaling.NONE: 1.0, LrScaling.LINEAR: ratio, LrScaling.SQRT: ratio ** 0.5}[self]


class TrainingMode(StrEnum):
    """How a job's workers turn their rows into model updates (the job spec's `mode`). The
    master, its dispatcher, ledger and rounds are the same in every mode; each mode is one
    training step class on the worker (worker/step_registry.py).

    ALLREDUCE: dense data parallelism. Every worker holds the whole model; each step sums every
    rank's gradients, sample counts and row ranges in one collective, and every rank applies the
    same update."""

    ALLREDUCE = "allreduce"  # every worker holds the model; one collective per step sums the gradients
    PS = "ps"  # embedding tables on parameter-server shards (elastic_step/ps); dense weights by allreduce


class DeviceChoice(StrEnum):
    """Where workers compute (--device); frameworks/device.py applies the one placement rule."""

    AUTO = "auto"  # a GPU when the worker sees one, else the CPU
    CPU = "cpu"  # the CPU, even where GPUs are visible
    CUDA = "cuda"  # a GPU, or a one-line refusal at the worker's pre-flight


class Precision(StrEnum):
    """What the forward pass computes in (--precision); parameters and the step buffer stay float32."""

    FP32 = "fp32"  # full precision: the reference, and the default
    BF16 = "bf16"  # autocast to bfloat16: float32's range, no loss scale needed
    FP16 = "fp16"  # autocast to float16, with a loss scale that never skips a step (frameworks/loss_scale.py)


class Request(BaseModel):
    """What a client sends: strict types, no unknown fields."""

    model_config = ConfigDict(strict=True, extra="forbid")


class ErrorReply(BaseModel):
    """The body of every refusal (401, 403, 404, 409): what went wrong and what to do."""

    detail: str


class EngineVersion(Request):
    """Which elastic-step a process runs: its release and a digest of this protocol. A worker
    whose engine differs from its master's would follow other rules in the same rounds (a
    field it does not know, a step it fills differently) and hang or corrupt them."""

    release: str = Field(max_length=64)
    protocol: str = Field(max_length=64)

    def __str__(self) -> str:
        return f"elastic-step {self.release} (protocol {self.protocol})"


class RegisterRequest(Request):
    worker_id: WorkerId
    pid: Int = Field(default=0, ge=0, le=2**31)
    host: str = Field(default="", max_length=253)
    engine: EngineVersion | None = None  # None: a release from before workers said which they run


class JobSpec(BaseModel):
    """What a worker needs to know about the job, handed out at registration."""

    job_name: str
    model_def: str
    manifest: str
    minibatch_size: int
    seed: int
    global_batch_size: int = 0  # rows every step applies, whatever the group's size; 0: minibatch_size per rank
    lr_scaling: LrScaling = LrScaling.NONE
    mode: TrainingMode = TrainingMode.ALLREDUCE  # how workers combine their rows into steps
    device: DeviceChoice = DeviceChoice.AUTO  # where each worker computes (frameworks/device.py)
    precision: Precision = Precision.FP32
    full_batch: int = 0  # rows of a step of the full group (minibatch_size x MAX workers): lr_scaling's reference
    store_host: str
    store_port: int
    collective_timeout_s: float
    heartbeat_interval_s: float
    master_timeout_s: float
    features: list[str]
    label: str
    checkpoint_steps: int = 0  # rank 0 checkpoints every K steps and at each epoch end; 0: never
    ps_routing: dict = {}  # mode ps: the shards' RoutingTable (epoch, owners, endpoints) as JSON


class GpuSample(Request):
    """One GPU the worker can use, as NVML sees it."""

    index: Int = Field(ge=0, le=1024)
    name: str = Field(default="", max_length=128)
    utilization_percent: float = Field(ge=0, le=100, allow_inf_nan=False)
    memory_used_bytes: Count
    memory_total_bytes: Count


class ResourceSample(Request):
    """What a worker process uses now: its CPU (percent of one core, so above 100 on several
    cores), its resident memory and its GPUs. Measured by the worker itself, so both backends
    show the same figures."""

    time: float = Field(ge=0, allow_inf_nan=False)
    cpu_percent: float = Field(ge=0, le=100.0 * MAX_WORLD, allow_inf_nan=False)
    rss_bytes: Count
    gpus: list[GpuSample] = Field(default=[], max_length=64)


class HeartbeatRequest(Request):
    worker_id: WorkerId
    round_id: RoundId = 0
    step: Int = Field(default=-1, ge=-1, le=MAX_INT)
    resources: ResourceSample | None = None  # optional: an older worker sends none


class HeartbeatReply(BaseModel):
    round_id: int
    # The newest *final* step: a worker forgets the ranges of steps up to it. A step that is
    # only reported may still be voided by a regroup, and its number then reused by the next
    # round's different step; acknowledging it would make workers forget that step's ranges.
    acked_step: int
    action: Literal["continue", "stop"]


class RangeRecord(Request):
    task_id: Count
    offset: Count
    count: Int = Field(gt=0, le=MAX_INT)


MAX_RANGES_PER_RANK = 1024  # tasks one rank may touch in one step
RankRanges = Annotated[list[RangeRecord], Field(min_length=1, max_length=MAX_RANGES_PER_RANK)]


class StepRecord(Request):
    step: Int = Field(ge=1, le=MAX_INT)
    # By rank: None (no data), its one range, or (with a fixed global batch, a rank that finished
    # a task within the step) its ranges in the order it consumed them.
    ranges: list[RangeRecord | RankRanges | None] = Field(min_length=1, max_length=MAX_WORLD)
    samples: Count
    loss: float = Field(allow_inf_nan=False)
    passes_again: Count = 0  # float16 passes computed again at a smaller loss scale in this step, over every rank
    time: float = Field(ge=0, allow_inf_nan=False)
    checkpoint: bool = False  # rank 0 snapshotted its state after this step


class RendezvousRequest(Request):
    worker_id: WorkerId
    step: Int = Field(ge=-1, le=MAX_INT)
    unacked: list[StepRecord] = Field(default=[], max_length=MAX_STEPS_PER_REQUEST)
    left_round: RoundId = 0  # the round this worker just left (0: none)


class RendezvousReply(BaseModel):
    status: Rendezvous
    round_id: int = 0
    rank: int = 0
    world_size: int = 0
    store_prefix: str = ""
    source_rank: int = 0
    start_step: int = 0
    acked_step: int = 0
    initial_state: Literal["", "checkpoint", "model"] = ""  # the source loads it from the master first


class TaskRequest(Request):
    worker_id: WorkerId
    round_id: RoundId


class TaskInfo(BaseModel):
    id: int
    epoch: int
    shard: int
    start: int
    count: int


class TaskReply(BaseModel):
    status: TaskStatus
    task: TaskInfo | None = None


class TaskFailedRequest(Request):
    worker_id: WorkerId
    task_id: Count
    error: Message


class StepsRequest(Request):
    worker_id: WorkerId
    round_id: RoundId
    steps: list[StepRecord] = Field(min_length=1, max_length=MAX_STEPS_PER_REQUEST)


class StepsReply(BaseModel):
    acked_step: int
    epoch: int = 0  # the epoch in progress (rank 0 checkpoints when it moves on)
    checkpoint_now: bool = False  # the job is stopping: rank 0 checkpoints its next step


class CollectiveFailedRequest(Request):
    worker_id: WorkerId
    round_id: RoundId
    error: Message = ""


class FailJobRequest(Request):
    worker_id: WorkerId
    reason: Message


class ScaleRequest(Request):
    workers: Int = Field(ge=1, le=MAX_WORLD)


class PsScaleRequest(Request):
    shards: Int = Field(ge=1, le=128)  # at most the virtual shards (ps/routing.py's default)


class Empty(BaseModel):
    """The reply of a call that only reports something."""


# ---- what /status and /events answer: read by `get`, `top`, `list`, the live page and the report --
# The events people are shown (`get -e`, the live page, the KFP report): deaths, relaunches,
# regroups, scaling (of the workers and of the PS shards), checkpoints and the job's end. The rest (joins, rounds proposed, task
# failures) are for the master's log and events.jsonl.
SHOWN_EVENTS: tuple[EventKind, ...] = (
    EventKind.DIED, EventKind.DROPPED, EventKind.RELAUNCHED, EventKind.NOT_RELAUNCHED, EventKind.SLOT_EXHAUSTED,
    EventKind.LEFT, EventKind.REGROUPED, EventKind.RECOVERED, EventKind.SCALED, EventKind.PS_SCALE_STARTED,
    EventKind.PS_SCALE_FINISHED, EventKind.CHECKPOINT,
    EventKind.RESTORED, EventKind.COLLECTIVE_FAILED, EventKind.MASTER_PAUSED, EventKind.STOP_REQUESTED, EventKind.STOPPED,
    EventKind.PREEMPTED, EventKind.JOB_FAILED, EventKind.JOB_SUCCEEDED,
)


class Status(BaseModel):
    """A reply read back by a client: fields it does not know (from a newer master, or what a
    backend adds) are kept, not refused, so an operator's older CLI still shows a newer job."""

    model_config = ConfigDict(extra="allow")


class EventRecord(Status):
    """One event as events.jsonl, /events and the published status hold it: its kind and time,
    a message for people, and the fields of its kind (worker, step, reason, seconds...)."""

    time: float
    event: EventKind
    message: str = ""


class EventsReply(Status):
    events: list[EventRecord]
    next: int = Field(ge=0)


class WorkerStatus(Status):
    """One worker in /status; the backend adds where it runs (pid, or pod, phase and node)."""

    id: str
    slot: int = Field(ge=0)
    state: WorkerState
    rank: int | None = None
    spare: bool = False
    step: int = -1
    rows_applied: int = 0
    exit: str | None = None
    host: str | None = None
    launched_at: float | None = None
    last_seen: float | None = None
    exited_at: float | None = None
    resources: ResourceSample | None = None


class PsShardStatus(Status):
    """One parameter-server shard in /status (a `--mode ps` job): its numbers as of its master's
    last stats poll, every few seconds."""

    shard: int = Field(ge=0)
    address: str
    state: PsShardState
    rows: int = 0  # embedding rows it holds, over all its tables
    bytes: int = 0  # what those rows and their optimizer slots take
    pushes: int = 0  # pushes applied (each once), over all its tables
    updates_per_s: float | None = None  # pushes applied per second between its last two polls; None before a second one
    relaunches: int = 0


class JobStatus(Status):
    """What /status answers, status.json keeps and the Kubernetes status ConfigMap publishes.
    A job that ended before it ever reported keeps only its name and state."""

    job: str
    state: JobState
    started_at: float | None = None
    ended_at: float | None = None
    stopping: bool = False
    failure: str | None = None
    round: int | None = None
    round_ready: bool = False
    world_size: int | None = None
    target_workers: int | None = None
    workers_range: tuple[int, int] | None = None
    epoch: int | None = None
    epochs: int | None = None
    rows_done: int | None = None
    rows_total: int | None = None
    step: int | None = None
    loss: float | None = None
    samples_per_s: float | None = None
    spares: int = 0
    workers: list[WorkerStatus] = []
    ps_shards: list[PsShardStatus] = []  # a --mode ps job's parameter-server shards


def _protocol_digest() -> str:
    """A digest of every route and every message's schema: equal in two processes exactly when
    they speak the same protocol, whatever release number they carry."""
    messages = {name: obj.model_json_schema() for name, obj in sorted(globals().items())
                if isinstance(obj, type) and issubclass(obj, BaseModel) and obj.__module__ == __name__}
    words = {name: sorted(obj) for name, obj in sorted(globals().items())
             if isinstance(obj, type) and issubclass(obj, StrEnum) and obj.__module__ == __name__}
    text = json.dumps({"api": API, "messages": messages, "words": words}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@functools.cache
def this_engine() -> EngineVersion:
    """The engine this process runs. The release is the installed distribution's (an image
    built from another release says so even where the sources look alike)."""
    try:
        release = importlib.metadata.version("elastic-step")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        from elastic_step import __version__ as release
    return EngineVersion(release=release, protocol=_protocol_digest())
