"""Running one training job: validate inputs, start the store, the API and the workers,
supervise until the data is applied, then save and evaluate the final model."""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

import uvicorn

from elastic_step.backends.api import LaunchSpec
from elastic_step.backends.registry import create_backend
from elastic_step.config import TrainConfig
from elastic_step.data.manifest import load_manifest, validate_shards
from elastic_step.data.reader import ShardReader
from elastic_step.errors import ConfigError, JobFailed, ModelDefinitionError
from elastic_step.evaluation import evaluate
from elastic_step.frameworks.model_def import batch_arrays, load_model_definition
from elastic_step.frameworks.registry import build_trainer
from elastic_step.master.api import create_app
from elastic_step.master.dispatcher import Dispatcher
from elastic_step.master.events import EventLog, StepLog
from elastic_step.master.ledger import Ledger
from elastic_step.master.progress import ProgressDisplay
from elastic_step.master.state import InitialState, MasterState, Timeouts
from elastic_step.protocol import JobSpec
from elastic_step.tracking.recorder import TrainingRecorder

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

    def to_json(self) -> dict:
        return self.__dict__


def bind_socket(host: str, port: int, what: str) -> socket.socket:
    # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted connections of
    # sockets that say so, and without it every keep-alive reply waits ~40 ms (Nagle meets
    # delayed ACK). Accepted sockets inherit the listener's TCP_NODELAY as well.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
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


def write_private(path: str, text: str) -> None:
    """Write a file only its owner can read (the job token)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


def check_model_definition(config: TrainConfig, manifest):
    """Import the model definition and run one tiny batch through it here, so a broken one
    fails before any worker starts."""
    model_def = load_model_definition(config.model_def)
    trainer = build_trainer(model_def, seed=config.seed)
    batch = ShardReader(manifest).read("train", 0, 0, min(2, manifest.splits["train"][0].rows))
    try:
        features, labels = batch_arrays(model_def, batch, manifest.features, manifest.label)
        trainer.loss_value(trainer.predict(features), labels)
    except Exception as exc:
        raise ModelDefinitionError(
            f"model definition {config.model_def!r} fails on a batch of {config.data}: {type(exc).__name__}: {exc}"
        ) from exc
    return model_def, trainer


class ApiServer:
    def __init__(self, app, sock: socket.socket):
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True, name="api")

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)


def job_params(config: TrainConfig, manifest) -> dict:
    """Everything in the job's configuration, plus what identifies its data."""
    skip = {"worker_env", "progress", "resume"}
    params = {k: v for k, v in vars(config).items() if k not in skip and v is not None}
    params.update(data_content_hash=manifest.content_hash, train_rows=manifest.rows("train"), features=len(manifest.features))
    return params


def run_job(config: TrainConfig) -> JobResult:
    started = time.time()
    manifest = load_manifest(config.data)
    validate_shards(manifest, [s for s in ("train", "test") if manifest.splits.get(s)])
    model_def, trainer = check_model_definition(config, manifest)
    os.makedirs(config.job_dir, exist_ok=True)
    # MLflow first: unreachable tracking is an error before any port is bound or worker starts.
    recorder = TrainingRecorder(config, manifest, trainer, model_def)

    import torch.distributed as dist  # the store that hosts every round's rendezvous

    api_socket = bind_socket(config.host, config.port, "master API")
    store = dist.TCPStore(config.host, 0, is_master=True, wait_for_workers=False)
    url = f"http://{config.host}:{api_socket.getsockname()[1]}"
    token = secrets.token_urlsafe(32)
    token_file = os.path.join(config.job_dir, "token")
    write_private(token_file, token)
    for stale in ("events.jsonl", "result.json") + (() if recorder.resumed else ("metrics.jsonl",)):
        if os.path.exists(os.path.join(config.job_dir, stale)):
            os.remove(os.path.join(config.job_dir, stale))

    shards = manifest.splits["train"]
    dispatcher = Dispatcher(
        [s.rows for s in shards], [s.path for s in shards], config.rows_per_task, config.epochs,
        shuffle=config.shuffle, seed=config.seed, max_task_failures=config.max_task_failures,
    )
    ledger = Ledger(dispatcher, config.audit)
    initial = None
    # --resume, or a retried pipeline step whose run was found by its pipeline run id tag
    checkpoint = recorder.resume_checkpoint()
    if checkpoint is not None:
        dispatcher.restore(checkpoint.ledger)
        ledger.resume_from(checkpoint.step)
        initial = InitialState("checkpoint", checkpoint.state, checkpoint.step)
        print(f"resuming run {recorder.run_id} from its checkpoint of step {checkpoint.step} (epoch {checkpoint.epoch + 1})", file=sys.stderr)
    elif recorder.resumed:
        print(f"no checkpoint to resume from in run {recorder.run_id}; starting from the beginning", file=sys.stderr)
    elif config.init_from:
        initial = InitialState("model", recorder.warm_start_model(config.init_from), 0)
    if not recorder.resumed:
        recorder.log_params(job_params(config, manifest))
    events = EventLog(os.path.join(config.job_dir, "events.jsonl"), listener=recorder.on_event)
    step_log = StepLog(os.path.join(config.job_dir, "metrics.jsonl"), listener=recorder.on_step)
    spec = JobSpec(
        job_name=config.job_name, model_def=config.model_def, manifest=manifest.root, minibatch_size=config.minibatch_size,
        seed=config.seed, store_host=config.host, store_port=store.port, collective_timeout_s=config.collective_timeout,
        heartbeat_interval_s=config.heartbeat_interval, master_timeout_s=config.master_timeout,
        features=manifest.features, label=manifest.label, checkpoint_steps=config.checkpoint_steps,
    )
    backend = create_backend(config.backend, LaunchSpec(url, token_file, config.job_dir, dict(config.worker_env)), config=config)
    state = MasterState(
        spec, dispatcher, ledger, backend, events, config.min_workers, config.max_workers, config.max_relaunches,
        Timeouts(config.heartbeat_timeout, config.rendezvous_timeout, config.startup_grace),
        step_log=step_log, initial_state=initial,
        on_checkpoint=recorder.on_checkpoint if config.checkpoint_steps else None,
    )
    server = ApiServer(create_app(state, token), api_socket)
    server.start()
    with open(os.path.join(config.job_dir, "master.json"), "w") as f:
        json.dump({"url": url, "pid": os.getpid(), "job": config.job_name, "token_file": token_file, "backend": config.backend}, f)

    previous_sigterm = signal.signal(signal.SIGTERM, lambda *_: state.fail("the master received SIGTERM"))
    progress = ProgressDisplay(enabled=config.progress)
    try:
        state.launch_all()
        with progress:
            while not state.over:
                state.tick()
                progress.update(state.status())
                time.sleep(0.05)
            progress.update(state.status())
    except KeyboardInterrupt:
        state.fail("interrupted")
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
        # Finished workers leave on their own; give them a moment, then end the rest.
        backend.shutdown(grace_s=10.0 if state.state == "succeeded" else 2.0)
        server.stop()
        ledger.close()
        step_log.close()
        del store
    if state.state != "succeeded":
        recorder.finish(False, config.job_dir)
        raise JobFailed(f"job {config.job_name} failed: {state.failure}")

    trainer.load_model_bytes(state.final_model)
    model_dir = os.path.join(config.job_dir, "model")
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "model.bin"), "wb") as f:
        f.write(state.final_model)
    with open(os.path.join(model_dir, "model.json"), "w") as f:
        json.dump({"framework": trainer.framework, "model_def": config.model_def, "steps": ledger.applied_step,
                   "data": manifest.root, "content_hash": manifest.content_hash}, f, indent=2)
    metrics = evaluate(trainer, model_def, manifest, "test")
    model_uri = recorder.finish(True, config.job_dir, metrics)
    result = JobResult(
        mlflow_uri=recorder.uri, run_id=recorder.run_id, model_uri=model_uri or "",
        job_dir=config.job_dir, model_dir=model_dir, test_metrics=metrics, steps=ledger.applied_step,
        rows_audited=ledger.rows_final, recoveries_s=[e["seconds"] for e in events.of("recovered")],
        seconds=round(time.time() - started, 2),
    )
    with open(os.path.join(config.job_dir, "result.json"), "w") as f:
        json.dump(result.to_json(), f, indent=2)
    return result
