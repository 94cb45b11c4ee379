"""The master's parameter-server shards for a `--mode ps` job, started with it (`start_ps_shards`):
processes of this machine (local backend), or those of a backend that runs them itself
(kubernetes' pods) behind ShardLauncher.

The tables are the model definition's PsEmbedding modules. Each shard is a child process bound
to 127.0.0.1 that checks the job's token (the file the workers read theirs from) on every
request; its folder is JOB_DIR/ps/shard-I (snapshot, ledger, ready.json). The workers get the
routing table with the shards' addresses in their job spec (`ps_routing`).

Beside this module, one job each:
- ps_tables.py: the tables' specs, and whether their declared sizes fit the shards;
- ps_local.py: the local shard processes from start to end (a resume's cut, a move left
  mid-way finished, a last snapshot each at the job's end and the trained tables frozen);
- ps_supervisor.py: a local shard that dies relaunched on its old port;
- ps_monitor.py: each shard's numbers for `get`, `top`, /status and the MLflow run
  (ps.shardI.*), and `scale --ps N`;
- ps_rows.py: the master's own models' rows: pulled from the running shards (validation),
  then read from their last snapshots (the test-set evaluation, the exported models), in
  JOB_DIR/model/ps_shards for tables larger than `--ps-table-limit-mb`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from functools import partial
from typing import Protocol

from elastic_step import defaults
from elastic_step.config import TrainConfig
from elastic_step.master.events import EventLog
from elastic_step.master.ps_checkpoints import PS_CUT
from elastic_step.master.ps_local import start_local
from elastic_step.master.ps_monitor import Metric, ShardMonitor
from elastic_step.master.ps_rows import LiveRows
from elastic_step.master.ps_supervisor import ShardSupervisor
from elastic_step.master.ps_tables import check_table_sizes, table_specs
from elastic_step.protocol import TrainingMode
from elastic_step.ps import wire
from elastic_step.ps.api import PsError, TableSpec
from elastic_step.ps.client import PsClient
from elastic_step.ps.embedding import bind_tables

log = logging.getLogger("elastic_step.master")


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
        ps_local.py's `_stop_and_freeze` does)."""
        ...


def start_ps_shards(config: TrainConfig, token_file: str, running: contextlib.ExitStack, resuming: bool = False,
                    metric: Metric | None = None, launcher: ShardLauncher | None = None, cut: dict | None = None,
                    events: EventLog | None = None, checkpoints=None) -> tuple[dict, ShardMonitor | None]:
    """Start the job's shards (nothing for another mode): the job spec's `ps_routing`, and the
    monitor whose rows /status shows (None for another mode). `launcher`: the backend's, when
    it runs the shards itself; else they are processes of this machine (ps_local.py's `start_local`).
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
        supervisor = start_local(config, specs, token_file, running, resuming, cut)
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
