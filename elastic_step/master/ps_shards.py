"""The master's parameter-server shards for a `--mode ps` job (local backend; a backend that
runs them itself, kubernetes' pods, does so behind ShardLauncher).

The tables are the model definition's PsEmbedding modules. Each shard is a child process bound
to 127.0.0.1 that checks the job's token (the file the workers read theirs from) on every
request; its folder is JOB_DIR/ps/shard-I (snapshot, ledger, ready.json). The workers get the
routing table with the shards' addresses in their job spec (`ps_routing`).

While they run the master's own model (validation) pulls from them. At the job's end they are
sent SIGTERM, which makes each take a last snapshot, and the master's models get the trained
tables from those snapshots as buffers (the test-set evaluation, the exported models). Tables
larger than `--ps-table-limit-mb` are not held whole: the snapshots go to JOB_DIR/model/ps_shards
(ps/shard_tables.py), logged with the model, and the master's models look their rows up there.

`scale --ps N` (ShardMonitor.scale) adds or removes shard processes while the job trains,
moving only the virtual shards that change owner (ps/moves.py); the workers learn the new
routing from the shards' refusals of the old epoch and no worker restarts.

`get`, `top` and /status show each shard (ShardMonitor: its address, state, rows, bytes, pushes
applied, updates per second and relaunches), and the job's MLflow run gets each shard's numbers
as ps.shardI.*.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Protocol

import numpy as np

from elastic_step import defaults
from elastic_step.config import TrainConfig
from elastic_step.backends.kubernetes.options import parse_quantity, request_and_limit
from elastic_step.errors import ConfigError
from elastic_step.frameworks.model_def import load_model_definition
from elastic_step.master.events import EventLog
from elastic_step.master.ps_checkpoints import PS_CUT, restore_cut
from elastic_step.protocol import EventKind, PsShardState, TrainingMode
from elastic_step.ps import sizing, snapshot, wire
from elastic_step.ps.api import PsError, ShardsStopped, ShardUnavailable, Status, TableSpec
from elastic_step.ps.client import PsClient
from elastic_step.ps.embedding import bind_tables, freeze_tables, ps_tables
from elastic_step.ps.index import MAX_ROWS
from elastic_step.ps.local import LocalShards, saved_routings
from elastic_step.ps.moves import move, release
from elastic_step.ps.routing import RoutingTable
from elastic_step.ps.shard_tables import SHARDS_FOLDER, ShardTables, weight_bytes, write_folder
from elastic_step.ps.state import SNAPSHOT_FILE

log = logging.getLogger("elastic_step.master")

STOP_TIMEOUT_S = 60.0  # a shard's last snapshot on SIGTERM
FINISH_AT_STOP_S = 30.0  # a request of a move finished at the job's end: the shards are up, or it is left to a resume
MIB = 1 << 20


def table_specs(model_def_source: str, net=None) -> list[TableSpec]:
    """The tables the model definition keeps on the shards: its net's PsEmbedding modules or layers."""
    if net is None:
        net = load_model_definition(model_def_source).model()
    specs = [embedding.ps_table.spec for embedding in ps_tables(net)]  # PyTorch's or Keras'
    if not specs:
        raise ConfigError(f"--mode ps: the model definition {model_def_source} has no PsEmbedding table; declare its "
                          "embeddings with elastic_step.ps.torch_embedding's or keras_embedding's PsEmbedding, "
                          "or use --mode allreduce")
    return specs


def check_table_sizes(config: TrainConfig, specs: list[TableSpec], shards: int | None = None) -> None:
    """Tables of declared size (PsEmbedding's rows=) that their shards could not hold are refused
    before anything starts (and before a scale --ps to `shards`), rather than a shard dying of OOM
    an hour into the run."""
    shards = config.ps_shards if shards is None else shards
    too_big = sizing.too_many_rows(specs, shards)
    if too_big is not None:
        raise ConfigError(f"--mode ps: table {too_big.name!r} declares {too_big.rows:,} rows, over {MAX_ROWS:,} a shard "
                          f"across {shards} shards; run more shards (--ps-shards)")
    memory, where = _shard_memory(config, shards)
    need = sizing.shard_bytes(specs, shards)
    if memory is not None and need > memory:
        declared = ", ".join(f"{s.name!r} {s.rows:,} rows x {sizing.bytes_per_row(s):.0f} B" for s in specs if s.rows)
        raise ConfigError(f"--mode ps: the tables ({declared}) need {need / 2**30:.1f} GiB on each of {shards} shards, "
                          f"more than {where} ({memory / 2**30:.1f} GiB); run more shards (--ps-shards) or give them "
                          "more memory (--ps-memory)")


def _shard_memory(config: TrainConfig, shards: int) -> tuple[float | None, str]:
    """(bytes one of `shards` shards may use, where that figure comes from); None where nothing limits it."""
    if config.backend != "kubernetes":  # the shard processes share this machine (or the step's pod)
        return sizing.local_memory_bytes() / shards, "this machine's memory divided among them"
    for option, value in (("--ps-memory", config.ps_memory), ("--worker-memory", config.worker_memory)):
        if value:
            request, limit = request_and_limit(option, value)
            return parse_quantity(option, limit or request), f"each shard pod's {option} limit"
    return None, ""


def check_ps_tables(config: TrainConfig, trainer) -> None:
    """Before anything starts: a --mode ps job's model has tables for the shards, and another
    mode's has none (its workers would fail at their first step, PyTorch's or TensorFlow's way)."""
    model = getattr(trainer, "net", None)
    model = getattr(trainer, "model", None) if model is None else model
    if config.mode == TrainingMode.PS:
        check_table_sizes(config, table_specs(config.model_def, model))
    elif model is not None and ps_tables(model):
        raise ConfigError(f"--mode {config.mode}: the model definition {config.model_def} keeps its embedding tables on "
                          "parameter-server shards (PsEmbedding); train it with --mode ps")


Metric = Callable[[str, float, int, float], None]  # (key, value, step, time): the run's log_metric


class ShardLauncher(Protocol):
    """A backend that runs the shards itself (kubernetes: pods of the job,
    backends/kubernetes/ps_pods.py) instead of this machine's processes."""

    def start_shards(self, specs: list[TableSpec], count: int, token: str, resuming: bool, running: contextlib.ExitStack,
                     cut: dict | None = None, checkpoints=None, checkpoint_every: int = 0,
                     table_limit_mb: float = defaults.PS_TABLE_LIMIT_MB) -> ShardSupervisor:
        """Start `count` shards and watch them (relaunching one that dies); at `running`'s close
        stop them with a last snapshot and freeze their tables into this process's models. The
        returned watcher has ShardSupervisor's attributes (shards, ports, states, relaunches, stopping).
        A resume starts them from `cut` (the checkpoint's, ps_checkpoints.py), whose files the
        launcher keeps in `checkpoints` (the run's checkpoint store) when the shards' own folders
        do not outlive them: its watcher's `keep_cut(cut)` copies each checkpoint's there before
        the checkpoint is recorded (see `keeping_cuts`). `checkpoint_every`: --checkpoint-steps.
        `table_limit_mb`: --ps-table-limit-mb, which decides how the tables are frozen (as
        `_stop_and_freeze` does)."""
        ...


def start_ps_shards(config: TrainConfig, token_file: str, running: contextlib.ExitStack, resuming: bool = False,
                    metric: Metric | None = None, launcher: ShardLauncher | None = None, cut: dict | None = None,
                    events: EventLog | None = None, checkpoints=None) -> tuple[dict, ShardMonitor | None]:
    """Start the job's shards (nothing for another mode): the job spec's `ps_routing`, and the
    monitor whose rows /status shows (None for another mode). `launcher`: the backend's, when
    it runs the shards itself; else they are processes of this machine (`_start_local`).
    `cut`: the resumed checkpoint's cut of the shards (ps_checkpoints.py), which they start from.
    `events`: the job's event log, where a scale --ps is recorded. `checkpoints`: the run's
    checkpoint store, for a launcher that keeps the shards' cuts there."""
    if config.mode != TrainingMode.PS:
        return {}, None
    specs = table_specs(config.model_def)
    token = wire.read_token(token_file)
    if launcher is not None:
        supervisor = launcher.start_shards(specs, config.ps_shards, token, resuming, running, cut=cut,
                                           checkpoints=checkpoints, checkpoint_every=config.checkpoint_steps,
                                           table_limit_mb=config.ps_table_limit_mb)
    else:
        supervisor = _start_local(config, specs, token_file, running, resuming, cut)
    shards = supervisor.shards
    running.callback(supervisor.stop)  # stops before the shards do (last in, first out)
    monitor = ShardMonitor(supervisor, token, metric, events, fits=partial(check_table_sizes, config, specs)).start()
    running.callback(monitor.stop)
    routes = shards.routes()
    live = LiveRows(PsClient(token, shards.routes))  # current after a scale --ps
    running.callback(live.close)
    bind_tables({spec.name: partial(live.pull, spec.name) for spec in specs})  # validation during training
    log.info("parameter servers: %d shards at %s holding %s", config.ps_shards, ", ".join(routes.endpoints),
             ", ".join(f"{s.name} (dim {s.dim}, {s.optimizer})" for s in specs))
    return routes.to_json(), monitor


def keeping_cuts(monitor: ShardMonitor | None, record: Callable | None) -> Callable | None:
    """`record` (a checkpoint's), preceded by the shards' `keep_cut` where their launcher keeps
    each checkpoint's cut in the checkpoint store (kubernetes: a pod's folder goes with it). A
    cut that cannot be kept is no checkpoint, as one a shard cannot cut (one line)."""
    keep = getattr(monitor.supervisor, "keep_cut", None) if monitor is not None else None
    if keep is None or record is None:
        return record

    def recording(step: int, epoch: int, state: bytes, ledger: dict):
        try:
            keep(ledger[PS_CUT])
        except (PsError, OSError, ValueError) as exc:
            log.warning("checkpoint of step %d not taken: the parameter-server shards' cut could not be copied to the "
                        "checkpoint store: %s", step, exc)
            return False  # not taken: no CHECKPOINT event, and a stop waits for the next one (ps_checkpoints.py)
        return record(step, epoch, state, ledger)

    return recording


def _start_local(config: TrainConfig, specs: list[TableSpec], token_file: str, running: contextlib.ExitStack,
                 resuming: bool, cut: dict | None = None) -> ShardSupervisor:
    """The shards as processes of this machine, each with its folder under JOB_DIR/ps.

    A job resumed from a checkpoint with the shards' cut starts every shard from that cut
    (ps_checkpoints.py). One resumed from a checkpoint without it (taken before cuts existed)
    keeps its shards' folders: their snapshots and ledgers hold every update acknowledged before
    the master stopped, and the rows re-trained after the checkpoint push the same keys, which
    the shards drop. Any other start begins with empty tables."""
    root = os.path.join(config.job_dir, "ps")
    if not resuming:
        shutil.rmtree(root, ignore_errors=True)
    elif cut is not None:
        restore_cut(root, cut)
    newest, previous = _last_move(saved_routings(root) if resuming else [])
    count = max(newest.shards, previous.shards if previous else 0) if newest else config.ps_shards
    # Shards that had not taken the newest routing start on the previous one: the move's adopt
    # then marks what they gain as pending, instead of their serving it empty.
    shards = LocalShards(root, specs, count, token_file, routing=previous or newest, checkpoint_every=config.checkpoint_steps)
    running.callback(_stop_and_freeze, shards, specs, config)
    shards.start()
    if newest is not None and newest.epoch > 1:
        _finish_move(shards, newest, previous, wire.read_token(token_file))
    return ShardSupervisor(shards).start()


def _last_move(saved: list[dict]) -> tuple[RoutingTable | None, RoutingTable | None]:
    """A resumed job's newest routing (None before any scale --ps), and the one its last move
    started from when that move is not finished (some shard on an older epoch, or waiting for
    rows), else None."""
    if not saved:
        return None, None
    newest = max((RoutingTable.from_json(r) for r in saved), key=lambda r: r.epoch)
    previous = next((r["previous"] for r in saved if r["epoch"] == newest.epoch and r.get("previous")), None)
    incomplete = len(saved) < newest.shards or any(r["epoch"] < newest.epoch or r.get("pending") for r in saved)
    return newest, RoutingTable.from_json(previous) if incomplete and previous else None


def _finish_move(shards: LocalShards, newest: RoutingTable, previous: RoutingTable | None, token: str,
                 deadline_s: float = 120.0) -> None:
    """After a scale --ps, at a resume: a move the last master did not see through is done
    again (each of its steps is idempotent), and the shards beyond it stopped; else every shard
    forgets any row it gave away (a release the master stopped mid-way may not have reached it)."""
    client = PsClient(token, lambda: None, timeout_s=deadline_s)
    try:
        call = lambda i, *request: client.call(shards.shards[i].endpoint, *request)  # noqa: E731
        if previous is not None:
            log.warning("parameter servers: finishing the move to routing epoch %d that was left mid-way", newest.epoch)
            move(call, previous, newest, deadline_s=deadline_s)
        else:
            release(call, range(len(shards.shards)), deadline_s)
    finally:
        client.close()
    shards.routing = newest
    for shard in shards.shards[newest.shards :]:
        shard.kill(signal.SIGTERM)
    shards.shards = shards.shards[: newest.shards]


def _finish_a_failed_scale(shards: LocalShards) -> None:
    """A scale --ps that did not finish (its master said so) may have left rows on their way,
    or, past its imports, stale copies on the old owners that its release did not drop, while
    training went on under the new routing: the move is finished now, so that the final model
    takes every row from the shard that trained it last. One that cannot be finished now (a
    shard gone) is said in one line; the model then holds the rows of the routing the master knew."""
    newest = None
    try:  # whatever goes wrong here, the shards are stopped and the tables read below
        newest, previous = _last_move(saved_routings(shards.root))
        # The master's routing reaches a move's epoch only once the move finished (resize, or a
        # resume's _finish_move): a removed shard's folder, left at an older epoch, is no sign.
        if newest is None or newest.epoch <= shards.routing.epoch:
            return
        needed = max(newest.shards, previous.shards if previous else 0)
        if len(shards.shards) < needed or any(s.process is None or s.process.poll() is not None for s in shards.shards):
            raise PsError(f"it needs {needed} running shards")
        log.warning("parameter servers: finishing the move to routing epoch %d before the tables are read", newest.epoch)
        _finish_move(shards, newest, previous, wire.read_token(shards.token_file), deadline_s=FINISH_AT_STOP_S)
    except Exception as exc:  # said in one line, and the job's end goes on
        log.error("parameter servers: the move to routing epoch %s did not finish (%s): the final model holds the rows "
                  "of routing epoch %d, some of them older than the trained ones; resume the job (train --resume) to "
                  "finish the move", newest.epoch if newest else "?", exc, shards.routing.epoch)


def _stop_and_freeze(shards: LocalShards, specs: list[TableSpec], config: TrainConfig) -> None:
    """SIGTERM every shard (a last snapshot each), then give this process's models the trained
    tables from the snapshots: whole (embedding.freeze_tables) when they fit --ps-table-limit-mb,
    else looked up in the snapshots themselves (`serve_from_snapshots`)."""
    _finish_a_failed_scale(shards)
    for shard in shards.shards:
        if shard.process is not None and shard.process.poll() is None:
            shard.process.send_signal(signal.SIGTERM)
    for shard in shards.shards:
        if shard.process is not None:
            try:
                shard.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("shard %d did not stop in %.0f s: killed, its last snapshot may be older", shard.shard, STOP_TIMEOUT_S)
                shard.process.kill()
                shard.process.wait()
    # The shards the routing names (a move that could not be finished above: those it started from).
    named = shards.shards[: shards.routing.shards]
    snapshots = [os.path.join(s.directory, SNAPSHOT_FILE) for s in named]
    folder = os.path.join(config.job_dir, "model", SHARDS_FOLDER)
    size = weight_bytes(snapshots, specs)
    if size > config.ps_table_limit_mb * MIB:
        serve_from_snapshots(folder, specs, shards.routing, snapshots, size)
        return
    shutil.rmtree(folder, ignore_errors=True)  # an earlier attempt's (a resumed job's): this model holds its tables
    freeze_tables({spec.name: snapshot_table(spec, [s.directory for s in named]) for spec in specs})


def serve_from_snapshots(folder: str, specs: list[TableSpec], routing: RoutingTable, snapshots: list[str], size: int) -> None:
    """Tables too big to hold whole: the shards' snapshots and routing go to `folder` (beside the
    final model's weights, logged with them, and served by the run's pyfunc model), and this
    process's models look their rows up there, shard by shard, memory-mapped."""
    log.info("parameter servers: the tables' %.1f MiB exceed --ps-table-limit-mb; the model is served from the "
             "shards' snapshots (%s)", size / MIB, folder)
    shutil.rmtree(folder, ignore_errors=True)
    write_folder(folder, specs, routing, snapshots)
    bind_tables(ShardTables.open(folder).sources())


def snapshot_table(spec: TableSpec, directories: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(ids, weights) of every row the shards' snapshots hold of a table (optimizer slots left out)."""
    ids, rows = [np.zeros(0, np.int64)], [np.zeros((0, spec.dim), np.float32)]
    for directory in directories:
        tables, _ = snapshot.load(os.path.join(directory, SNAPSHOT_FILE), [spec.name])
        if spec.name in tables:
            ids.append(tables[spec.name]["ids"])
            rows.append(tables[spec.name]["rows"][:, : spec.dim])
    return np.concatenate(ids), np.concatenate(rows)


class LiveRows:
    """Pulls from the running shards for the master's own model, one at a time (the client keeps
    one connection per shard)."""

    CLOSE_WAIT_S = 5.0

    def __init__(self, client: PsClient):
        self.client = client
        self.lock = threading.Lock()

    def pull(self, table: str, ids: np.ndarray) -> np.ndarray:
        if self.client.giving_up:
            raise ShardsStopped("the parameter-server shards have stopped")
        with self.lock:
            try:
                return self.client.pull(table, ids)
            except ShardUnavailable as exc:
                if self.client.giving_up:
                    raise ShardsStopped(f"the parameter-server shards stopped during the pull ({exc})") from exc
                raise

    def close(self) -> None:
        """The shards are about to stop (the job's end): a pull under way (a validation still in
        MLflow's queue) ends at its next retry, saying the shards stopped, instead of retrying for
        its minute; a later one at once. The tables are frozen from the snapshots next."""
        self.client.giving_up = True
        if self.lock.acquire(timeout=self.CLOSE_WAIT_S):  # its connections are the pulling thread's until then
            try:
                self.client.close()
            finally:
                self.lock.release()


class ShardSupervisor:
    """Relaunches a shard process that dies while the job runs, on its old port, so the workers'
    routes stay right: it loads its snapshot, replays its ledger's tail and listens again, while
    the workers' clients retry what it did not acknowledge (ps/client.py). No worker restarts."""

    POLL_S = 0.2
    TRIES = 3  # a shard that cannot come back three times in a row (a broken snapshot) is left down
    READY_TIMEOUT_S = 120.0

    def __init__(self, shards: LocalShards):
        self.shards = shards
        self.ports = [int(shard.ready()["port"]) for shard in shards.shards]
        self.stopping = threading.Event()
        self.states = [PsShardState.SERVING for _ in shards.shards]  # read by ShardMonitor, written here only
        self.relaunches = [0 for _ in shards.shards]
        self.thread = threading.Thread(target=self._watch, name="ps-supervisor", daemon=True)

    def start(self) -> ShardSupervisor:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()

    def resized(self) -> None:
        """Follow the shards' list after a scale --ps: the added ones serve, the removed ones gone."""
        count = len(self.shards.shards)
        self.ports = self.ports[:count] + [int(shard.ready()["port"]) for shard in self.shards.shards[len(self.ports):]]
        self.states = (self.states + [PsShardState.SERVING] * count)[:count]
        self.relaunches = (self.relaunches + [0] * count)[:count]

    def _watch(self) -> None:
        while not self.stopping.wait(self.POLL_S):
            for shard, port in zip(self.shards.shards, self.ports):
                down = self.states[shard.shard] is PsShardState.DOWN
                if shard.process.poll() is not None and not down and not self.stopping.is_set():
                    self._relaunch(shard, port)

    def _relaunch(self, shard, port: int) -> None:
        log.warning("parameter-server shard %d exited with code %s: relaunching it on port %d", shard.shard,
                    shard.process.returncode, port)
        started = time.monotonic()
        self.states[shard.shard] = PsShardState.RELAUNCHING
        for _ in range(self.TRIES):
            shard.start(port)
            try:
                info = shard.wait_ready(self.READY_TIMEOUT_S)
            except (RuntimeError, TimeoutError) as exc:
                log.warning("parameter-server shard %d did not come back: %s", shard.shard, exc)
                if shard.process.poll() is None:
                    shard.process.kill()
                shard.process.wait()
                if self.stopping.wait(1.0):
                    return
                continue
            self.relaunches[shard.shard] += 1
            self.states[shard.shard] = PsShardState.SERVING
            log.info("parameter-server shard %d back in %.2f s: snapshot loaded in %.3f s, %d ledger records replayed "
                     "in %.3f s", shard.shard, time.monotonic() - started, info.get("load_s", 0.0),
                     info.get("replayed", 0), info.get("replay_s", 0.0))
            return
        log.error("parameter-server shard %d is down for good after %d tries; the workers' pushes to it will fail",
                  shard.shard, self.TRIES)
        self.states[shard.shard] = PsShardState.DOWN


class ShardMonitor:
    """Each shard's numbers for /status and the MLflow run: its `stats` asked every STATS_S on
    this thread (never under the master's lock; a shard that does not answer keeps its last
    numbers), its state and relaunches from the supervisor. Logged as ps.shardI.rows, .bytes
    and .pushes (their sums over the shard's tables), and .updates_per_s (the pushes it applied
    since its previous answered poll over the seconds between them), the poll's count as the
    metric's step."""

    STATS_S = 2.0
    CUT_WAIT_S = 120.0  # a scale --ps waits this long for a checkpoint's cut or a rollback to let go of the shards
    SCALE_WAIT_AT_STOP_S = 300.0  # the job's end waits this long for a scale --ps under way (each request of a move: 120 s at most)

    def __init__(self, supervisor: ShardSupervisor, token: str, metric: Metric | None = None, events: EventLog | None = None,
                 clock: Callable[[], float] = time.monotonic, fits: Callable[[int], None] | None = None):
        self.supervisor = supervisor
        self.fits = fits  # raises ConfigError when the declared tables would not fit that many shards
        self.metric = metric
        self.events = events  # the job's: each scale --ps is recorded there (get -e)
        self.addresses = [f"{shard.host}:{port}" for shard, port in zip(supervisor.shards.shards, supervisor.ports)]
        self.client = PsClient(token, lambda: None, timeout_s=5.0)  # call() only: no routing needed
        self.numbers = [{"rows": 0, "bytes": 0, "pushes": 0} for _ in self.addresses]
        self.clock = clock  # monotonic: a rate must not jump with the wall clock
        self.answered: list[tuple[int, float] | None] = [None for _ in self.addresses]  # (pushes, clock) at its last answer
        self.rates: list[float | None] = [None for _ in self.addresses]  # updates/s between its last two answers
        self.polls = 0
        self.stopping = threading.Event()
        self.polling = threading.Lock()
        self.scaling = threading.Lock()  # the shards' rows are being moved or cut: one at a time
        self.scale_asked = threading.Lock()  # a scale --ps is asked for: a second one is refused
        self.unfinished: str | None = None  # why the last scale --ps did not finish: none more until a resume
        self.rolling_back = threading.Event()  # the shards go back to a checkpoint (ps_rollback.py): no checkpoint meanwhile
        self.thread = threading.Thread(target=self._watch, name="ps-monitor", daemon=True)

    def start(self) -> ShardMonitor:
        self.poll()  # the first rows before /status is first asked
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        # A scale --ps under way is let finish (a new one is refused from now on): the job's end
        # then stops the shards, or finishes a move that failed, with no move beside it.
        if self.scale_asked.acquire(timeout=self.SCALE_WAIT_AT_STOP_S):
            self.scale_asked.release()
        else:
            log.error("parameter servers: a scale --ps still runs after %.0f s; the shards are stopped under it",
                      self.SCALE_WAIT_AT_STOP_S)
        self.thread.join()
        self.poll()  # the shards' last numbers, before they are stopped
        self.client.close()

    def scale(self, shards: int) -> dict:
        """`scale --ps`: run `shards` shard processes from now on; what moved (moves.MoveReport).
        ValueError (the API's 409) when there is nothing to do or it cannot be done now. Its
        start and finish are events of the job (get -e), the finish with the rows moved and pauses."""
        if not self.scale_asked.acquire(blocking=False):
            raise ValueError("another scale --ps of this job is under way; try again when it is done")
        try:
            # A checkpoint's cut holds the shards for a moment: the operator's scale waits for it
            # rather than failing on a timing it cannot see.
            if not self.scaling.acquire(timeout=self.CUT_WAIT_S):
                raise ValueError(f"a checkpoint's cut or a rollback has held the shards for {self.CUT_WAIT_S:.0f} s; "
                                 "try again when it is done (get -e shows it)")
            try:
                return self._scale(shards)
            finally:
                self.scaling.release()
        finally:
            self.scale_asked.release()

    def _scale(self, shards: int) -> dict:
        supervisor = self.supervisor
        before = len(supervisor.shards.shards)
        self._check_scale(before, shards)
        sizes = {"shards_from": before, "shards_to": shards}
        self._event(EventKind.PS_SCALE_STARTED, **sizes)
        client = PsClient(self.client.token, lambda: None, timeout_s=120.0)
        try:
            report = supervisor.shards.resize(shards, client.call)
        except PsError as exc:
            log.error("parameter servers: the move to %d shards did not finish: %s", shards, exc)
            self.unfinished = f"the move to {shards} shards did not finish ({exc})"
            self._event(EventKind.PS_SCALE_FINISHED, f"did not finish: {exc}", ok=False, **sizes)
            raise ValueError(f"the move to {shards} shards did not finish ({exc}); the shards are left mid-move: stop "
                             "the job and resume it (train --resume), which finishes the move") from exc
        finally:
            client.close()
        supervisor.resized()
        self._restart_numbers(shards)
        moved = report.to_json()
        # what get -e shows (one line): the rows moved and the longest a moved virtual shard was refused
        self._event(EventKind.PS_SCALE_FINISHED, ok=True, **sizes, rows_moved=report.rows_moved, rows_total=report.rows_total,
                    pause_max_s=moved["pause_max_s"], seconds=moved["seconds"], routing_epoch=report.epoch)
        return moved

    def _restart_numbers(self, shards: int) -> None:
        """After a scale: the new shards' addresses, and every shard's count taken now, so that the
        next poll has its rate (a job may end soon after a scale). The moved rows took their
        applied pushes with them, so no count from before the move is a base for a rate. Under
        the polling lock: a poll under way would otherwise set a base from before the move."""
        with self.polling:
            self.follow()
            self.numbers = (self.numbers + [{"rows": 0, "bytes": 0, "pushes": 0} for _ in range(shards)])[:shards]
            self.answered = [None] * shards
            self.rates = [None] * shards
            try:
                self._poll()
            except Exception as exc:  # the move is done: numbers are not worth failing it for
                log.warning("parameter servers: the shards' numbers after the scale were not read: %s", exc)

    def follow(self) -> None:
        """The shards' addresses as they are now (after a scale --ps, or a shard made anew by a rollback)."""
        supervisor = self.supervisor
        self.addresses = [f"{shard.host}:{port}" for shard, port in zip(supervisor.shards.shards, supervisor.ports)]

    def _check_scale(self, before: int, shards: int) -> None:
        supervisor = self.supervisor
        if self.stopping.is_set() or supervisor.stopping.is_set():
            raise ValueError("the job is ending; there is nothing to scale")
        if self.unfinished is not None:  # a second move would start from a routing the shards have left
            raise ValueError(f"{self.unfinished}: stop the job and resume it (train --resume), which finishes that move, "
                             "then scale")
        if shards == before:
            raise ValueError(f"the job already runs {shards} parameter-server shards")
        if not 1 <= shards <= len(supervisor.shards.routing.owners):
            raise ValueError(f"{shards} shards: use between 1 and {len(supervisor.shards.routing.owners)} (the virtual shards)")
        down = [i for i, state in enumerate(supervisor.states) if state is not PsShardState.SERVING]
        if down:
            raise ValueError(f"shard {down[0]} is {supervisor.states[down[0]]}; scale once every shard serves")
        if self.fits is not None:
            try:  # fewer shards hold more each: a declared table may no longer fit their memory
                self.fits(shards)
            except ConfigError as exc:
                raise ValueError(str(exc)) from None

    def _event(self, kind: EventKind, message: str = "", **fields) -> None:
        """Recorded and written at once (events.jsonl, the log, the run): this thread holds no
        master lock."""
        if self.events is not None:
            self.events.add(kind, message, **fields)
        else:
            log.info("%s %s %s", kind.value, message, fields)

    def rows(self) -> list[dict]:
        """One PsShardStatus each, as of the last poll."""
        rows = zip(self.addresses, self.supervisor.states, self.numbers, self.rates, self.supervisor.relaunches)  # zip: a scale may be resizing them
        return [{"shard": i, "address": address, "state": state, **numbers, "updates_per_s": rate, "relaunches": relaunches}
                for i, (address, state, numbers, rate, relaunches) in enumerate(rows)]

    def poll(self) -> None:
        with self.polling:  # this thread's and a scale --ps's (one client, one count of polls)
            self._poll()

    def _poll(self) -> None:
        self.polls += 1
        now = time.time()
        for i, address in enumerate(self.addresses):
            try:
                reply = self._stats(address)
            except (OSError, ValueError) as exc:  # down or relaunching: its last numbers stand, but not its rate
                log.debug("parameter-server shard %d did not answer its stats: %s", i, exc)
                self._unanswered(i)
                continue
            if reply.get("status") != Status.OK:
                log.debug("parameter-server shard %d refused its stats: %s", i, reply.get("detail"))
                self._unanswered(i)
                continue
            tables = reply.get("tables", {}).values()
            if i >= len(self.numbers):  # removed by a scale --ps meanwhile
                break
            self.numbers[i] = {key: sum(int(t[key]) for t in tables) for key in ("rows", "bytes", "pushes")}
            self._rate(i, self.numbers[i]["pushes"])
            if self.metric is not None:
                logged = {**self.numbers[i], "updates_per_s": self.rates[i]}
                for key, value in logged.items():
                    if value is not None:
                        self.metric(f"ps.shard{i}.{key}", value, self.polls, now)

    def _unanswered(self, i: int) -> None:
        """A shard that does not answer applies nothing we can see; its next answer's rate spans the gap."""
        if i < len(self.rates):
            self.rates[i] = None

    def _rate(self, i: int, pushes: int) -> None:
        """Shard i's updates per second since its previous answer. None after its first answer,
        and when its count went down (a shard relaunched without its rows, or put back to a
        checkpoint's cut by a rollback): no negative rate."""
        now = self.clock()
        before = self.answered[i] if i < len(self.answered) else None
        rate = None
        if before is not None and pushes >= before[0] and now > before[1]:
            rate = (pushes - before[0]) / (now - before[1])
        if i < len(self.answered):  # a scale --ps may have cut the lists meanwhile
            self.answered[i] = (pushes, now)
            self.rates[i] = rate

    def _stats(self, address: str) -> dict:
        """A shard's stats, asked again once on a new connection when the kept one fails: a shard
        relaunched since the last poll closed it (the last poll before the shards stop would
        otherwise keep the numbers it had before it died)."""
        try:
            return self.client.call(address, {"op": "stats"})[0]
        except OSError:
            return self.client.call(address, {"op": "stats"})[0]  # call() dropped the broken connection

    def _watch(self) -> None:
        while not self.stopping.wait(self.STATS_S):
            self.poll()
