"""The local backend's shard processes kept running while the job trains: one that dies is
relaunched on its old port (ShardSupervisor), and its state and relaunches are what
ShardMonitor (ps_monitor.py) shows.
"""

from __future__ import annotations

import logging
import threading
import time

from elastic_step.protocol import PsShardState
from elastic_step.ps.local import LocalShards

log = logging.getLogger("elastic_step.master")


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
