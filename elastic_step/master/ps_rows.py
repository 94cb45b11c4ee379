"""Where the master's own models get a `--mode ps` job's table rows: from the running shards
while the job trains (LiveRows: validation), and from the shards' last snapshots after it (the
test-set evaluation, the exported models): whole (`snapshot_table`), or, for tables larger than
`--ps-table-limit-mb`, looked up in the snapshots themselves, laid out in JOB_DIR/model/ps_shards
(`serve_from_snapshots`, ps/shard_tables.py) and logged with the model.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading

import numpy as np

from elastic_step.ps import snapshot
from elastic_step.ps.api import ShardsStopped, ShardUnavailable, TableSpec
from elastic_step.ps.client import PsClient
from elastic_step.ps.embedding import bind_tables
from elastic_step.ps.routing import RoutingTable
from elastic_step.ps.shard_tables import ShardTables, write_folder
from elastic_step.ps.state import SNAPSHOT_FILE

log = logging.getLogger("elastic_step.master")

MIB = 1 << 20


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
