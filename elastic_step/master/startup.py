"""Starting a job's master: the ledger and where the job starts, the API's socket and server,
the job's tokens and files, the backend and (mode ps) the shards. Each is registered with the
ExitStack the job runs in, so they are released in one place, in the reverse order of starting
(the order matters, and the comments beside each registration say why)."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import sys
import threading
import time
from dataclasses import dataclass

import uvicorn

from elastic_step.audit import start_audit
from elastic_step.backends.api import LaunchSpec
from elastic_step.backends.registry import create_backend
from elastic_step.config import TrainConfig
from elastic_step.defaults import LOG_FORMAT
from elastic_step.durable import write_json_atomic, write_private
from elastic_step.errors import ConfigError, JobFailed
from elastic_step.master.api import PAGE_REFRESH_S, create_app, server_config
from elastic_step.master.dispatcher import Dispatcher
from elastic_step.master.events import EventLog, StepLog, notable_log
from elastic_step.master.ledger import Ledger
from elastic_step.master.ps_checkpoints import checkpointing, resumed_cut
from elastic_step.master.ps_rollback import roll_back_on_loss
from elastic_step.master.ps_shards import keeping_cuts, start_ps_shards
from elastic_step.master.publisher import StatusPublisher
from elastic_step.master.restore import InitialState, RestorePoint, restart_from
from elastic_step.master.state import MasterState, Timeouts
from elastic_step.master.store import RendezvousStore
from elastic_step.protocol import JobSpec, JobState
from elastic_step.tracking.recorder import TrainingRecorder

log = logging.getLogger("elastic_step.master")


def url_host(host: str) -> str:
    """The host as a URL names it: an IPv6 address in brackets (RFC 3986)."""
    return f"[{host}]" if ":" in host else host


def bind_socket(host: str, port: int, what: str) -> socket.socket:
    # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted connections of
    # sockets that say so, and without it every keep-alive reply waits ~40 ms (Nagle meets
    # delayed ACK). Accepted sockets inherit the listener's TCP_NODELAY as well.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # a pod's IPv6 address (status.podIP) too
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"{what} port {port} on {host} is already in use ({exc.strerror}); "
            "pass --port 0 to pick a free one, or stop the process holding it"
        ) from None
    return sock


class ApiServer:
    def __init__(self, app, sock: socket.socket):
        self.app = app
        self.server = uvicorn.Server(server_config(app))  # with its connection limits
        self.failure: BaseException | None = None  # why the server's thread ended before it served
        self.thread = threading.Thread(target=self._serve, args=(sock,), daemon=True, name="api")

    def _serve(self, sock: socket.socket) -> None:
        try:
            self.server.run(sockets=[sock])
        except BaseException as exc:  # start() says it on the master's thread; later, the log does
            self.failure = exc
            log.error("the master's API stopped: %s: %s", type(exc).__name__, exc, exc_info=not isinstance(exc, SystemExit))

    STARTUP_S = 60.0  # uvicorn serves within a second; a loaded machine may take longer

    def start(self) -> None:
        """Serve, or fail the job: a master whose API never served would write master.json
        naming an address nobody answers, and its workers would fail one by one instead."""
        self.thread.start()
        deadline = time.monotonic() + self.STARTUP_S
        while not self.server.started:
            if not self.thread.is_alive():
                # uvicorn says why it exits (SystemExit) on the master's standard error, not in its log
                cause = (f"{type(self.failure).__name__}: {self.failure}" if self.failure and not isinstance(self.failure, SystemExit)
                         else "uvicorn's reason is on the master's standard error")
                raise JobFailed(f"the master's API ended before it served ({cause}): no worker could have reached it; "
                                "run the job again")
            if time.monotonic() > deadline:
                self.server.should_exit = True
                raise JobFailed(f"the master's API did not serve within {self.STARTUP_S:.0f} s: the machine may be "
                                "overloaded; run the job again")
            time.sleep(0.01)

    def stop(self) -> None:
        # A live page that is watching gets one more refresh, so it shows how the job ended: wait
        # for its next poll (a few refresh periods at most; a slow machine makes polls late).
        ended = time.monotonic()
        polled = getattr(self.app.state, "last_page_poll", None)
        if polled is not None and ended - polled < 5 * PAGE_REFRESH_S:
            while self.app.state.last_page_poll <= ended and time.monotonic() - ended < 3 * PAGE_REFRESH_S:
                time.sleep(0.05)
            time.sleep(0.2)  # the poll's other requests (status, events) come with it
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(5)


@dataclass
class Master:
    """What a running job's master holds. Everything it started is released by the ExitStack
    `start_master` was given, in one place and in the reverse order of starting."""

    state: MasterState
    ledger: Ledger
    events: EventLog
    url: str
    token_file: str


TOKEN_FILE = "token"  # in the job folder: the job's token, which its workers and shards read


def plan_start(config: TrainConfig, recorder: TrainingRecorder, dispatcher: Dispatcher, ledger: Ledger) -> RestorePoint:
    """Where the job starts: this run's newest checkpoint (a retry of the same command, --resume,
    or a retried pipeline step), else the start with a warm-start model, else with a fresh model
    (no initial state). The same restore point is where the group goes back to while no newer
    checkpoint is taken, should every worker holding the model die (restore.py)."""
    checkpoint = recorder.resume_checkpoint()
    if checkpoint is not None:
        point = RestorePoint(checkpoint.step, InitialState("checkpoint", checkpoint.state, checkpoint.step), checkpoint.ledger)
        restart_from(point, dispatcher, ledger)
        print(f"resuming run {recorder.run_id} from its checkpoint of step {checkpoint.step} (epoch {checkpoint.epoch + 1})", file=sys.stderr)
        return point
    init_from = config.init_from
    if recorder.resumed:
        # Starting over: every row the earlier attempt applied is void, and the audit says so. From
        # the model the run started from, though this attempt was not told of it.
        init_from = init_from or recorder.lineage_warm_start()
        print(f"no checkpoint to resume from in run {recorder.run_id}; starting from the beginning"
              + (f" (warm start from {init_from})" if init_from else ""), file=sys.stderr)
    point = RestorePoint(0, InitialState("model", recorder.warm_start_model(init_from), 0) if init_from else None)
    if recorder.resumed:
        restart_from(point, dispatcher, ledger)
    return point


def start_master(config: TrainConfig, manifest, recorder: TrainingRecorder, running: contextlib.ExitStack,
                 warm_parent=None) -> Master:
    """The ledger and its starting point, the store, the API and the backend; every one of them
    registered with `running` for release. The phases run in this order, and each registers what
    it started as it starts it: the release order (last in, first out) follows from it."""
    dispatcher, ledger, start = _open_ledger(config, manifest, recorder, running)
    resuming = start.initial is not None and start.initial.kind == "checkpoint"
    listening = _listen(config, running)
    tokens = _write_tokens(config.job_dir)
    _remove_stale_files(config.job_dir, resuming)
    events, step_log = _open_logs(config, recorder, running)
    backend, ps_routing, ps_shards = _start_backend(config, recorder, running, warm_parent, listening, tokens.token_file,
                                                    events, start, resuming)
    spec = _job_spec(config, manifest, listening.store.port, ps_routing)
    state = _master_state(config, recorder, spec, dispatcher, ledger, backend, events, step_log, start, ps_shards)
    _serve(config, recorder, running, state, backend, events, listening, tokens)
    return Master(state, ledger, events, listening.url, tokens.token_file)


def _open_ledger(config: TrainConfig, manifest, recorder: TrainingRecorder,
                 running: contextlib.ExitStack) -> tuple[Dispatcher, Ledger, RestorePoint]:
    """The training split's tasks, the audit and the ledger of applied steps, and where the job
    starts (plan_start). A resumed run has its parameters logged already."""
    shards = manifest.splits["train"]
    dispatcher = Dispatcher(
        [s.rows for s in shards], [s.path for s in shards], config.rows_per_task, config.epochs,
        shuffle=config.shuffle, seed=config.seed, max_task_failures=config.max_task_failures,
    )
    start_audit(config.audit, resuming=recorder.resumed)
    ledger = Ledger(dispatcher, config.audit)
    running.callback(ledger.close)
    start = plan_start(config, recorder, dispatcher, ledger)
    if not recorder.resumed:
        recorder.log_params()
    return dispatcher, ledger, start


@dataclass
class _Listening:
    """Where the master is reached: the API's socket and its URL, and the rendezvous store."""

    api_socket: socket.socket
    store: RendezvousStore
    url: str

    @property
    def ports(self) -> list[int]:
        return [self.api_socket.getsockname()[1], self.store.port]


def _listen(config: TrainConfig, running: contextlib.ExitStack) -> _Listening:
    """The API's socket (bound here, so a port in use fails the job before any worker starts) and
    the rendezvous store, which `_serve` keeps alive until the workers are gone."""
    api_socket = bind_socket(config.host, config.port, "master API")
    running.callback(api_socket.close)
    store = RendezvousStore(config.host)  # hosts every round's rendezvous; listens on the API's host only
    url = f"http://{url_host(config.host)}:{api_socket.getsockname()[1]}"
    return _Listening(api_socket, store, url)


@dataclass(frozen=True)
class _Tokens:
    token: str
    token_file: str
    view_token: str
    view_token_file: str


def _write_tokens(job_dir: str) -> _Tokens:
    """The job's token, in the file its workers and shards read, and the view token."""
    token = secrets.token_urlsafe(32)
    token_file = os.path.join(job_dir, TOKEN_FILE)
    write_private(token_file, token)
    # A second token that opens only the read-only routes (status, events, history): for the live
    # page and for people who may watch the job but not steer it.
    view_token = secrets.token_urlsafe(32)
    view_token_file = os.path.join(job_dir, "view-token")
    write_private(view_token_file, view_token)
    return _Tokens(token, token_file, view_token, view_token_file)


def _remove_stale_files(job_dir: str, resuming: bool) -> None:
    """What an earlier attempt in the job folder left that would mislead this one."""
    # A resume from a checkpoint continues its step metrics; anything else starts them over.
    stale = ("events.jsonl", "result.json", FINAL_STATUS) + (() if resuming else ("metrics.jsonl",))
    for name in stale:
        if os.path.exists(os.path.join(job_dir, name)):
            os.remove(os.path.join(job_dir, name))


def _open_logs(config: TrainConfig, recorder: TrainingRecorder, running: contextlib.ExitStack) -> tuple[EventLog, StepLog]:
    """The master's own log, and the job's events and step metrics (each passed on to MLflow)."""
    running.enter_context(master_log(os.path.join(config.job_dir, "logs", "master.log")))
    events = EventLog(os.path.join(config.job_dir, "events.jsonl"), listener=recorder.on_event)
    step_log = StepLog(os.path.join(config.job_dir, "metrics.jsonl"), listener=recorder.on_step)
    running.callback(step_log.close)
    return events, step_log


def _start_backend(config: TrainConfig, recorder: TrainingRecorder, running: contextlib.ExitStack, warm_parent,
                   listening: _Listening, token_file: str, events: EventLog, start: RestorePoint, resuming: bool):
    """The backend that launches the workers, and (mode ps) the shards: the backend, the job
    spec's `ps_routing` and the shards' monitor (None for another mode)."""
    launch = LaunchSpec(listening.url, token_file, config.job_dir, dict(config.worker_env),
                        master_ports=listening.ports)  # what workers call: the job's NetworkPolicy
    backend = create_backend(config.backend, launch, config=config, **({"warm_parent": warm_parent} if warm_parent else {}))
    # mode ps: the shards (stopped after the workers; pods when the backend runs them), and their
    # numbers for /status and the run
    ps_routing, ps_shards = start_ps_shards(config, token_file, running, resuming, metric=recorder.tracker.log_metric,
                                            launcher=backend.shard_launcher(), cut=resumed_cut(start.ledger) if resuming else None,
                                            events=events, checkpoints=recorder.checkpoints)
    return backend, ps_routing, ps_shards


def _job_spec(config: TrainConfig, manifest, store_port: int, ps_routing: dict) -> JobSpec:
    """The job as every worker is told it at registration."""
    return JobSpec(
        job_name=config.job_name, model_def=config.model_def, manifest=manifest.root, minibatch_size=config.minibatch_size,
        seed=config.seed, store_host=config.host, store_port=store_port, collective_timeout_s=config.collective_timeout,
        heartbeat_interval_s=config.heartbeat_interval, master_timeout_s=config.master_timeout,
        features=manifest.features, label=manifest.label, checkpoint_steps=config.checkpoint_steps,
        global_batch_size=config.global_batch_size, lr_scaling=config.lr_scaling,
        device=config.device, precision=config.precision, full_batch=config.minibatch_size * config.max_workers,
        mode=config.mode, ps_routing=ps_routing,
    )


def _master_state(config: TrainConfig, recorder: TrainingRecorder, spec: JobSpec, dispatcher: Dispatcher, ledger: Ledger,
                  backend, events: EventLog, step_log: StepLog, start: RestorePoint, ps_shards) -> MasterState:
    """The master's state, which every API call and tick goes through."""
    state = MasterState(
        spec, dispatcher, ledger, backend, events, config.min_workers, config.max_workers, config.max_relaunches,
        Timeouts(config.heartbeat_timeout, config.rendezvous_timeout, config.startup_grace),
        step_log=step_log, initial_state=start.initial,
        # mode ps: a checkpoint is recorded with the shards' cut of its step (ps_checkpoints.py);
        # the shards keep the cuts of every checkpoint a resume may load (the run's committed ones)
        on_checkpoint=checkpointing(ps_shards, keeping_cuts(ps_shards, recorder.on_checkpoint if config.checkpoint_steps else None),
                                    lambda: list(recorder.checkpoints.committed)),
        spares=config.spares,
        ps_shards=ps_shards, restore_point=start,
    )
    if ps_shards is not None:  # its shards hold their part of the model: they go back only with a rollback
        roll_back_on_loss(ps_shards, state)
    return state


def _serve(config: TrainConfig, recorder: TrainingRecorder, running: contextlib.ExitStack, state: MasterState, backend,
           events: EventLog, listening: _Listening, tokens: _Tokens) -> None:
    """The last registrations for release (their order is the point: see each), then the API's
    server, master.json (where the job is reached) and, where the backend publishes it, the
    job's status."""
    # The job's last audit lines, events and steps, whichever thread queued them: registered
    # before the API's and the backend's stop, so it runs after them (their last heartbeats and
    # step reports queue writes too) and before the files the earlier phases opened are closed.
    running.callback(state.lock.writes.flush)
    # Registered before the API's stop, so it runs after it: the folder then names no address
    # where a later process could listen and be handed the token.
    running.callback(retire_master_info, config.job_dir, state)
    server = ApiServer(create_app(state, tokens.token, tokens.view_token), listening.api_socket)
    running.callback(server.stop)  # after the workers are gone (callbacks run last-in, first-out)
    # The last round's workers leave on their own; give them a moment, then end the rest. Any
    # other worker (a joiner still starting) is ended at once: waiting for it kept a finished
    # job alive for up to the whole grace.
    running.callback(lambda: backend.shutdown(grace_s=WORKERS_LEAVE_S.get(state.state, 2.0), members=state.last_members()))
    stores = [listening.store]
    running.callback(stores.clear)  # the store lives until the workers are gone
    server.start()
    write_json_atomic(os.path.join(config.job_dir, "master.json"),
                      {"url": listening.url, "pid": os.getpid(), "job": config.job_name, "token_file": tokens.token_file,
                       "view_token_file": tokens.view_token_file, "backend": config.backend, "started_at": state.started_at,
                       "mlflow": recorder.run_info()},
                      indent=None)
    if backend.publishes_status:  # stopped before the backend shuts down (callbacks run last-in, first-out)
        info = {"job": config.job_name, "backend": config.backend, "started_at": state.started_at, "mlflow": recorder.run_info()}
        running.callback(StatusPublisher(state, backend, events, info).start().close)


# How long finished workers get to leave on their own before the rest are ended (a preempted
# master has its grace period to keep to).
WORKERS_LEAVE_S = {JobState.SUCCEEDED: 10.0, JobState.STOPPED: 10.0, JobState.PREEMPTED: 3.0}
FINAL_STATUS = "status.json"  # the job's status as it ended: what `get` shows once the master is gone


def write_final_status(job_dir: str, state: MasterState) -> None:
    status = state.status()  # under the lock; the write is outside it
    status["ended_at"] = time.time()
    write_json_atomic(os.path.join(job_dir, FINAL_STATUS), status, indent=None)


def retire_master_info(job_dir: str, state: MasterState) -> None:
    """The master is gone: master.json goes, its final status already in its place."""
    write_final_status(job_dir, state)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(job_dir, "master.json"))


class _AtLeast(logging.Filter):
    """The console's level for the master's own log lines; the notable events pass at theirs."""

    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level or record.name == notable_log.name


@contextlib.contextmanager
def master_log(path: str):
    """The master's own log (its events, warnings, errors) in JOB_DIR/logs/master.log, for
    `elastic-step logs --master`; what reaches the console stays as the command line chose."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logger, root = logging.getLogger("elastic_step"), logging.getLogger()
    previous = logger.level
    console = _AtLeast(root.level if root.level != logging.NOTSET else logging.WARNING)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
        for h in root.handlers:
            h.addFilter(console)
    logger.addHandler(handler)
    try:
        yield path
    finally:
        logger.removeHandler(handler)
        handler.close()
        logger.setLevel(previous)
        for h in root.handlers:
            h.removeFilter(console)
