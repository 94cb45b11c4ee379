"""A `--mode ps` job's shards as processes of this machine (the local backend), from start to
end: each with its folder under JOB_DIR/ps, started from a resumed checkpoint's cut or
folders, finishing a move a scale --ps left mid-way (at a resume, or at the job's end before the
tables are read), and stopped at the job's end with a last snapshot each, whose tables this
process's models then get (ps_rows.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess

from elastic_step.config import TrainConfig
from elastic_step.master.ps_checkpoints import restore_cut
from elastic_step.master.ps_rows import MIB, serve_from_snapshots, snapshot_table
from elastic_step.master.ps_supervisor import ShardSupervisor
from elastic_step.ps import wire
from elastic_step.ps.api import PsError, TableSpec
from elastic_step.ps.client import PsClient
from elastic_step.ps.embedding import freeze_tables
from elastic_step.ps.local import LocalShards, saved_routings
from elastic_step.ps.moves import move, release
from elastic_step.ps.routing import RoutingTable
from elastic_step.ps.shard_tables import SHARDS_FOLDER, weight_bytes
from elastic_step.ps.state import SNAPSHOT_FILE

log = logging.getLogger("elastic_step.master")

STOP_TIMEOUT_S = 60.0  # a shard's last snapshot on SIGTERM
FINISH_AT_STOP_S = 30.0  # a request of a move finished at the job's end: the shards are up, or it is left to a resume


def start_local(config: TrainConfig, specs: list[TableSpec], token_file: str, running: contextlib.ExitStack,
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
        if previous is not None:
            log.warning("parameter servers: the move to routing epoch %d was left mid-way when the job stopped: "
                        "finishing it before the shards serve", newest.epoch)
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
    forgets any row it gave away (a release the master stopped mid-way may not have reached it).
    The caller says why it finishes the move (one line)."""
    client = PsClient(token, lambda: None, timeout_s=deadline_s)
    try:
        call = lambda i, *request: client.call(shards.shards[i].endpoint, *request)  # noqa: E731
        if previous is not None:
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
        log.warning("parameter servers: the move to routing epoch %d was left mid-way by a scale --ps that did not "
                    "finish: finishing it before the tables are read", newest.epoch)
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
