"""Running one training job: validate inputs, start the store, the API and the workers,
supervise until the data is applied, then save and evaluate the final model."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import socket
import sys
import threading
import time
from dataclasses import dataclass

import uvicorn

from elastic_step.audit import start_audit
from elastic_step.backends.api import LaunchSpec
from elastic_step.backends.local import warm_parent_for
from elastic_step.backends.registry import create_backend
from elastic_step.config import TrainConfig
from elastic_step.defaults import LOG_FORMAT
from elastic_step.data.manifest import load_manifest, validate_shards
from elastic_step.data.reader import ShardReader
from elastic_step.durable import fsync_path, write_atomic, write_json_atomic, write_private
from elastic_step.errors import ConfigError, JobFailed, JobPreempted, ModelDefinitionError
from elastic_step.frameworks.model_def import batch_arrays, load_model_definition
from elastic_step.frameworks.registry import build_trainer
from elastic_step.master.api import PAGE_REFRESH_S, create_app, server_config
from elastic_step.master.dispatcher import Dispatcher
from elastic_step.master.events import EventLog, StepLog, notable_log, show_notable_events
from elastic_step.master.ledger import Ledger
from elastic_step.master.preemption import GraceBudget, Sigterm, end_early, sigterm_as_preemption
from elastic_step.master.progress import ProgressDisplay
from elastic_step.master.ps_checkpoints import checkpointing, resumed_cut
from elastic_step.master.ps_rollback import roll_back_on_loss
from elastic_step.master.ps_shards import keeping_cuts, start_ps_shards
from elastic_step.master.ps_tables import check_ps_tables
from elastic_step.master.publisher import StatusPublisher
from elastic_step.master.restore import InitialState, RestorePoint, restart_from
from elastic_step.master.state import MasterState, Timeouts
from elastic_step.master.store import RendezvousStore
from elastic_step.protocol import EventKind, JobSpec, JobState
from elastic_step.tracking.recorder import TrainingRecorder
from elastic_step.tracking.run import tracking_errors
from elastic_step.tracking.uri import redact

log = logging.getLogger("elastic_step.master")


@dataclass
class JobResult:
    mlflow_uri: str
    run_id: str
    model_uri: str
    job_dir: str
    model_dir: str
    test_metrics: dict
    steps: int
    rows_audited: int
    recoveries_s: list[float]
    seconds: float
    # The membership history, for a pipeline's Metrics output: relaunched workers, re-formed rounds.
    relaunches: int = 0
    regroups: int = 0

    def to_json(self) -> dict:
        return self.__dict__


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


# What MLflow accepts as a metric name (mlflow.utils.validation): checked before training, since
# a validation or test metric it rejects would otherwise fail the job at its end.
METRIC_NAME = re.compile(r"^[\w\-./ :]+$")


def check_model_definition(config: TrainConfig, manifest):
    """Import the model definition and run one tiny batch through it here, so a broken one
    fails before any worker starts."""
    model_def = load_model_definition(config.model_def)
    trainer = build_trainer(model_def, seed=config.seed)
    batch = ShardReader(manifest).read("train", 0, 0, min(2, manifest.splits["train"][0].rows))
    try:
        features, labels = batch_arrays(model_def, batch, manifest.features, manifest.label)
        trainer.loss_value(trainer.predict(features), labels)
        names = list(model_def.metrics()) if model_def.metrics is not None else []
    except Exception as exc:
        raise ModelDefinitionError(
            f"model definition {config.model_def!r} fails on a batch of {config.data}: {type(exc).__name__}: {exc}"
        ) from exc
    for name in names:
        if not METRIC_NAME.match(f"val_{name}"):
            raise ModelDefinitionError(
                f"model definition {config.model_def!r}: metrics() key {name!r} is not a name MLflow accepts; "
                "rename it with letters, digits, _ - . / : and spaces only"
            )
    return model_def, trainer


class ApiServer:
    def __init__(self, app, sock: socket.socket):
        self.app = app
        self.server = uvicorn.Server(server_config(app))  # with its connection limits
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True, name="api")

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
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


def run_job(config: TrainConfig) -> JobResult:
    """Check the inputs, open the MLflow run, start the master, supervise until the data is
    applied (or the job fails, is stopped or preempted), then save, evaluate and record the model."""
    started = time.time()
    budget = GraceBudget(config.termination_grace)
    show_notable_events()
    with sigterm_as_preemption() as sigterm, contextlib.ExitStack() as early:
        # The workers' warm parent imports torch beside the checks and MLflow's start-up below
        # (it writes nothing until its first worker: a bad input leaves no trace of it).
        warm_parent = early.enter_context(warm_parent_for(config, os.path.join(config.job_dir, TOKEN_FILE)))
        manifest, model_def, trainer = check_inputs(config)
        if config.backend == "kubernetes":  # the cluster's refusal comes before an MLflow run is opened
            from elastic_step.backends.kubernetes.options import settings_from_config
            from elastic_step.backends.kubernetes.preflight import check_before_start

            check_before_start(settings_from_config(config).namespace)
        if sigterm.received:
            raise JobPreempted(f"job {config.job_name} preempted (SIGTERM) before it started; the same command starts it")
        # MLflow first: unreachable tracking, or a run that cannot be resumed with these inputs, is
        # an error before any port is bound or worker starts.
        with tracking_errors(f"job {config.job_name}"):
            recorder = TrainingRecorder(config, manifest, trainer, model_def)
        try:
            with tracking_errors(f"job {config.job_name}"):
                with contextlib.ExitStack() as running:
                    master = start_master(config, manifest, recorder, running, warm_parent)
                    supervise(master.state, recorder, config.progress, sigterm, budget)
                write_final_status(config.job_dir, master.state)
                if master.state.state in (JobState.STOPPED, JobState.PREEMPTED):
                    end_early(config, recorder, master, started, sigterm, budget)
                if master.state.state != JobState.SUCCEEDED:
                    raise JobFailed(f"job {config.job_name} failed: {master.state.failure}")
                return finish_job(config, manifest, recorder, trainer, master, started)
        except BaseException:
            try:  # the run is FAILED (and resumable), never left RUNNING; a stop or preemption is recorded already
                recorder.finish(False, config.job_dir, timeout_s=budget.left(sigterm.at))
            except Exception as exc:
                log.error("could not record the failure in MLflow: %s", redact(str(exc)[:300]))
            raise


def check_inputs(config: TrainConfig):
    """The data and the model definition, checked before anything starts."""
    manifest = load_manifest(config.data)
    validate_shards(manifest, [s for s in ("train", "val", "test") if manifest.splits.get(s)])
    model_def, trainer = check_model_definition(config, manifest)
    check_ps_tables(config, trainer)
    os.makedirs(config.job_dir, exist_ok=True)
    return manifest, model_def, trainer


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
    registered with `running` for release."""
    shards = manifest.splits["train"]
    dispatcher = Dispatcher(
        [s.rows for s in shards], [s.path for s in shards], config.rows_per_task, config.epochs,
        shuffle=config.shuffle, seed=config.seed, max_task_failures=config.max_task_failures,
    )
    start_audit(config.audit, resuming=recorder.resumed)
    ledger = Ledger(dispatcher, config.audit)
    running.callback(ledger.close)
    start = plan_start(config, recorder, dispatcher, ledger)
    initial = start.initial
    if not recorder.resumed:
        recorder.log_params()

    api_socket = bind_socket(config.host, config.port, "master API")
    running.callback(api_socket.close)
    store = RendezvousStore(config.host)  # hosts every round's rendezvous; listens on the API's host only
    url = f"http://{url_host(config.host)}:{api_socket.getsockname()[1]}"
    token = secrets.token_urlsafe(32)
    token_file = os.path.join(config.job_dir, TOKEN_FILE)
    write_private(token_file, token)
    # A second token that opens only the read-only routes (status, events, history): for the live
    # page and for people who may watch the job but not steer it.
    view_token = secrets.token_urlsafe(32)
    view_token_file = os.path.join(config.job_dir, "view-token")
    write_private(view_token_file, view_token)
    # A resume from a checkpoint continues its step metrics; anything else starts them over.
    stale = ("events.jsonl", "result.json", FINAL_STATUS) + (() if initial is not None and initial.kind == "checkpoint" else ("metrics.jsonl",))
    for name in stale:
        if os.path.exists(os.path.join(config.job_dir, name)):
            os.remove(os.path.join(config.job_dir, name))
    running.enter_context(master_log(os.path.join(config.job_dir, "logs", "master.log")))
    events = EventLog(os.path.join(config.job_dir, "events.jsonl"), listener=recorder.on_event)
    step_log = StepLog(os.path.join(config.job_dir, "metrics.jsonl"), listener=recorder.on_step)
    running.callback(step_log.close)

    resuming = initial is not None and initial.kind == "checkpoint"
    launch = LaunchSpec(url, token_file, config.job_dir, dict(config.worker_env),
                        master_ports=[api_socket.getsockname()[1], store.port])  # what workers call: the job's NetworkPolicy
    backend = create_backend(config.backend, launch, config=config, **({"warm_parent": warm_parent} if warm_parent else {}))
    # mode ps: the shards (stopped after the workers; pods when the backend runs them), and their
    # numbers for /status and the run
    ps_routing, ps_shards = start_ps_shards(config, token_file, running, resuming, metric=recorder.tracker.log_metric,
                                            launcher=backend.shard_launcher(), cut=resumed_cut(start.ledger) if resuming else None,
                                            events=events, checkpoints=recorder.checkpoints)
    spec = JobSpec(
        job_name=config.job_name, model_def=config.model_def, manifest=manifest.root, minibatch_size=config.minibatch_size,
        seed=config.seed, store_host=config.host, store_port=store.port, collective_timeout_s=config.collective_timeout,
        heartbeat_interval_s=config.heartbeat_interval, master_timeout_s=config.master_timeout,
        features=manifest.features, label=manifest.label, checkpoint_steps=config.checkpoint_steps,
        global_batch_size=config.global_batch_size, lr_scaling=config.lr_scaling,
        device=config.device, precision=config.precision, full_batch=config.minibatch_size * config.max_workers,
        mode=config.mode, ps_routing=ps_routing,
    )
    state = MasterState(
        spec, dispatcher, ledger, backend, events, config.min_workers, config.max_workers, config.max_relaunches,
        Timeouts(config.heartbeat_timeout, config.rendezvous_timeout, config.startup_grace),
        step_log=step_log, initial_state=initial,
        # mode ps: a checkpoint is recorded with the shards' cut of its step (ps_checkpoints.py);
        # the shards keep the cuts of every checkpoint a resume may load (the run's committed ones)
        on_checkpoint=checkpointing(ps_shards, keeping_cuts(ps_shards, recorder.on_checkpoint if config.checkpoint_steps else None),
                                    lambda: list(recorder.checkpoints.committed)),
        spares=config.spares,
        ps_shards=ps_shards, restore_point=start,
    )
    if ps_shards is not None:  # its shards hold their part of the model: they go back only with a rollback
        roll_back_on_loss(ps_shards, state)
    # The job's last audit lines, events and steps, whichever thread queued them: registered
    # before the API's and the backend's stop, so it runs after them (their last heartbeats and
    # step reports queue writes too) and before the files above are closed.
    running.callback(state.lock.writes.flush)
    # Registered before the API's stop, so it runs after it: the folder then names no address
    # where a later process could listen and be handed the token.
    running.callback(retire_master_info, config.job_dir, state)
    server = ApiServer(create_app(state, token, view_token), api_socket)
    running.callback(server.stop)  # after the workers are gone (callbacks run last-in, first-out)
    # The last round's workers leave on their own; give them a moment, then end the rest. Any
    # other worker (a joiner still starting) is ended at once: waiting for it kept a finished
    # job alive for up to the whole grace.
    running.callback(lambda: backend.shutdown(grace_s=WORKERS_LEAVE_S.get(state.state, 2.0), members=state.last_members()))
    stores = [store]
    running.callback(stores.clear)  # the store lives until the workers are gone
    server.start()
    write_json_atomic(os.path.join(config.job_dir, "master.json"),
                      {"url": url, "pid": os.getpid(), "job": config.job_name, "token_file": token_file,
                       "view_token_file": view_token_file, "backend": config.backend, "started_at": state.started_at,
                       "mlflow": recorder.run_info()},
                      indent=None)
    if backend.publishes_status:  # stopped before the backend shuts down (callbacks run last-in, first-out)
        info = {"job": config.job_name, "backend": config.backend, "started_at": state.started_at, "mlflow": recorder.run_info()}
        running.callback(StatusPublisher(state, backend, events, info).start().close)
    return Master(state, ledger, events, url, token_file)


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


def supervise(state: MasterState, recorder: TrainingRecorder, show_progress: bool, sigterm: Sigterm,
              budget: GraceBudget) -> None:
    """Launch the workers and tick the master until the job is over. SIGTERM is a preemption: the
    job checkpoints its next step within the grace period's first half and ends PREEMPTED. Ctrl-C
    and MLflow refusing a record for good each fail the job."""
    progress = ProgressDisplay(enabled=show_progress)
    preempting = False
    try:
        if not sigterm.received:  # a SIGTERM while the job started: no worker is launched to be stopped
            state.launch_all()
        with progress:
            while not state.over:
                if sigterm.received and not preempting:
                    preempting = True
                    log.warning("SIGTERM: checkpointing the next step within %.0fs, then yielding", budget.checkpoint_s)
                    state.preempt(max(0.0, sigterm.at + budget.checkpoint_s - time.monotonic()))
                state.tick()
                if recorder.error:
                    state.fail(recorder.error)
                if progress.due():  # the status is built only when it is shown
                    progress.update(state.status())
                state.wait_for_work(0.05)  # a failed collective ends the pause: its regroup is proposed at once
            progress.update(state.status())
    except KeyboardInterrupt:
        state.fail("interrupted")


def save_model(config: TrainConfig, manifest, trainer, model: bytes, steps: int) -> str:
    """The final model's parameters and description in JOB_DIR/model, each file replaced whole."""
    model_dir = os.path.join(config.job_dir, "model")
    os.makedirs(model_dir, exist_ok=True)
    write_atomic(os.path.join(model_dir, "model.bin"), model)
    write_json_atomic(os.path.join(model_dir, "model.json"), {
        "framework": trainer.framework, "model_def": config.model_def, "steps": steps,
        "data": manifest.root, "content_hash": manifest.content_hash,
    })
    return model_dir


def finish_job(config: TrainConfig, manifest, recorder: TrainingRecorder, trainer, master: Master, started: float) -> JobResult:
    state, ledger = master.state, master.ledger
    model_dir = save_model(config, manifest, trainer, state.final_model, ledger.applied_step)
    metrics = recorder.evaluate_model(state.final_model, "test")
    model_uri = recorder.finish(True, config.job_dir, metrics)
    if recorder.error:
        raise JobFailed(f"job {config.job_name} failed: {recorder.error}")
    result = JobResult(
        mlflow_uri=recorder.shown_uri, run_id=recorder.run_id, model_uri=model_uri or "",
        job_dir=config.job_dir, model_dir=model_dir, test_metrics=metrics, steps=ledger.applied_step,
        rows_audited=ledger.rows_final, recoveries_s=[e["seconds"] for e in master.events.of(EventKind.RECOVERED)],
        seconds=round(time.time() - started, 2),
        relaunches=len(master.events.of(EventKind.RELAUNCHED)), regroups=len(master.events.of(EventKind.REGROUPED)),
    )
    if config.audit and os.path.exists(config.audit):
        fsync_path(config.audit)  # the audit is whole on disk before the result vouches for it
    write_json_atomic(os.path.join(config.job_dir, "result.json"), result.to_json())
    return result
