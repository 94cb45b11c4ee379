"""A `--mode ps` job's trained tables from its shard pods at the job's end, for this process's
models (the test-set evaluation, the logged model), by the rule the local backend follows
(master/ps_local.py's _stop_and_freeze).

The pods still serve (they are deleted after this), and their folders are emptyDirs the master
cannot read. The size of the tables held whole is each shard's rows (`stats`, the count its
snapshot's headers would give) times their ids and weights. Up to `train --ps-table-limit-mb`,
each shard's rows come over the wire (`export`) and the master holds the tables whole
(freeze_tables). Beyond it, each shard takes a last snapshot and the master copies the file
(`snapshot_file`) into JOB_DIR/ps-final, then lays it out as the local backend does
(JOB_DIR/model/ps_shards with its manifest, serve_from_snapshots): the run logs it with the
pyfunc that serves from it. A shard that gives nothing is said in one line; its ids get zero rows.
"""

from __future__ import annotations

import logging
import os
import shutil

import numpy as np

from elastic_step.backends.kubernetes.ps_pod_shards import PodShards, asked, exported, fetch_snapshot
from elastic_step.master.ps_rows import MIB, serve_from_snapshots
from elastic_step.ps.api import PsError, TableSpec
from elastic_step.ps.client import PsClient
from elastic_step.ps.embedding import freeze_tables
from elastic_step.ps.moves import move, release
from elastic_step.ps.routing import RoutingTable
from elastic_step.ps.shard_tables import SHARDS_FOLDER, table_bytes

log = logging.getLogger("elastic_step.backends.kubernetes")

FINISH_S = 30.0  # a request of a move finished at the job's end: the pods still serve, or it is left to a resume
STAGING = "ps-final"  # under JOB_DIR: the snapshots copied from the pods, before they are laid out


def freeze(client: PsClient, specs: list[TableSpec], shards: PodShards, job_dir: str, limit_mb: float) -> None:
    """This process's models get the shards' trained tables: whole up to `limit_mb`, else looked
    up in the shards' snapshots, copied under `job_dir`."""
    folder = os.path.join(job_dir, "model", SHARDS_FOLDER)
    finish_a_failed_scale(client, shards)
    size = held_bytes(client, specs, shards)
    if size > limit_mb * MIB:
        staging = os.path.join(job_dir, STAGING)
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        try:
            serve_from_snapshots(folder, specs, shards.routing, copied_snapshots(client, shards, staging), size)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # laid out by hard links (or copies): these are spare
        return
    shutil.rmtree(folder, ignore_errors=True)  # an earlier attempt's (a resumed job's): this model holds its tables
    freeze_tables(whole_tables(client, specs, shards))


def finish_a_failed_scale(client: PsClient, shards: PodShards) -> None:
    """A scale --ps that did not finish (the master said so) but whose routing the shards took
    (training went on under it, perhaps past stale copies the release did not drop): the move is
    done again now (each step is idempotent: ps/moves.py), and the tables are read under its
    routing, as the local backend's end does (master/ps_local.py). One that cannot be finished
    is said in one line; the tables are then read under the routing the master knew.

    A newer epoch whose owners are the master's is no move: a rollback gives every shard the next
    epoch with a new pod's address alone (ps_pod_watch.py, PodSupervisor.roll_back), and one cut
    short leaves some shards ahead. The rows are where the master's routing says: nothing to do."""
    taken = []
    for shard in shards.shards:
        try:
            taken.append(RoutingTable.from_json(asked(client, shard, {"op": "routing"})["routing"]))
        except (OSError, ValueError, PsError):
            continue  # one that does not answer is said where its rows are read
    newest = max(taken, key=lambda routing: routing.epoch, default=shards.routing)
    if newest.epoch <= shards.routing.epoch:
        return
    if np.array_equal(newest.owners, shards.routing.owners):  # a rollback's bump cut short, not a scale's move
        log.info("parameter servers: routing epoch %d, which some shards took, gives the shards of epoch %d new "
                 "addresses only (a rollback's): no virtual shard changes owner, nothing to move before the tables "
                 "are read", newest.epoch, shards.routing.epoch)
        return
    try:
        if len(shards.shards) < newest.shards:
            raise PsError(f"it needs {newest.shards} shards and {len(shards.shards)} are known")
        log.warning("parameter servers: the move to routing epoch %d was left mid-way by a scale --ps that did not "
                    "finish: finishing it before the tables are read", newest.epoch)
        newest = RoutingTable(newest.epoch, newest.owners, [s.endpoint for s in shards.shards[: newest.shards]])
        call = lambda i, *request: client.call(shards.shards[i].endpoint, *request)  # noqa: E731
        held = [asked(client, shard, {"op": "stats"}) for shard in shards.shards]
        if all(h["epoch"] == newest.epoch and not h["pending"] for h in held):  # only a release was lost: no rows to send again
            release(call, range(len(shards.shards)), FINISH_S)
        else:
            move(call, shards.routing, newest, deadline_s=FINISH_S)
        shards.routing = newest
    except (OSError, ValueError, PsError) as exc:
        log.error("parameter servers: a move of the shards did not finish (%s): the tables are read under routing "
                  "epoch %d, some rows older than trained; resume the job (train --resume) to finish the move",
                  exc, shards.routing.epoch)


def held_bytes(client: PsClient, specs: list[TableSpec], shards: PodShards) -> int:
    """The ids and weights every shard holds (shard_tables.weight_bytes' sum, from `stats`)."""
    total = 0
    for shard in shards.shards[: shards.routing.shards]:
        try:
            held = asked(client, shard, {"op": "stats"})["tables"]
        except PsError as exc:
            log.error("parameter-server shard %d did not say what it holds (%s)", shard.shard, exc)
            continue
        total += sum(table_bytes(spec, int(held[spec.name]["rows"])) for spec in specs if spec.name in held)
    return total


SNAPSHOT_TRIES = 3  # a copy cut by a dropped connection, or by a snapshot replacing the file, is asked again


def copied_snapshots(client: PsClient, shards: PodShards, staging: str) -> list[str]:
    """Each shard's last snapshot copied to `staging`, by shard; a path not written for one that
    did not give it (shard_tables.write_folder: that shard holds nothing)."""
    paths = []
    for shard in shards.shards[: shards.routing.shards]:  # after a move that did not finish: the routing's own
        paths.append(os.path.join(staging, f"shard-{shard.shard}.bin"))
        for attempt in range(1, SNAPSHOT_TRIES + 1):
            try:
                fetch_snapshot(client, shard, paths[-1])
                break
            except (OSError, ValueError, PsError) as exc:
                if attempt == SNAPSHOT_TRIES:
                    log.error("parameter-server shard %d did not give its snapshot in %d tries (%s): its ids get zero "
                              "rows in the evaluation and the logged model", shard.shard, attempt, exc)
                else:
                    log.warning("parameter-server shard %d's snapshot copy failed (%s); asking again", shard.shard, exc)
    return paths


def whole_tables(client: PsClient, specs: list[TableSpec], shards: PodShards) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every shard's rows (`export` of the virtual shards it owns), by table: (ids, weights)."""
    parts: dict[str, list] = {s.name: [] for s in specs}
    for shard in shards.shards:
        try:
            for arrays in exported(client, shard, shards.routing.owned_by(shard.shard).tolist()):
                for spec in specs:
                    parts[spec.name].append((arrays[f"{spec.name}.ids"], arrays[f"{spec.name}.rows"][:, : spec.dim]))
        except (OSError, ValueError, PsError) as exc:
            log.error("parameter-server shard %d did not give its rows (%s): its ids get zero rows in the "
                      "evaluation and the exported model", shard.shard, exc)
    tables = {}
    for spec in specs:
        ids = [np.zeros(0, np.int64)] + [p[0] for p in parts[spec.name]]
        rows = [np.zeros((0, spec.dim), np.float32)] + [p[1] for p in parts[spec.name]]
        tables[spec.name] = (np.concatenate(ids), np.concatenate(rows))
    return tables
