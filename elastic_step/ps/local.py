"""Shard processes on this machine: launch, wait until ready, kill, relaunch.

What the local backend (and tests and benchmarks) need to run N shards: each shard has its own
folder (config.json, snapshot, ledger, ready.json) and is a `python -m elastic_step.ps.shard`
process. `routes()` reads every shard's ready.json, so a relaunched shard's new port reaches the
clients the way the master's routes would.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Callable

from elastic_step.ps.api import ShardsNotStarted, TableSpec
from elastic_step.ps.moves import MoveReport, move
from elastic_step.ps.routing import RoutingTable
from elastic_step.ps.shard import CONFIG_FILE, READY_FILE
from elastic_step.ps.state import ROUTING_FILE


def write_config(directory: str, specs: list[TableSpec], routing: RoutingTable, snapshot_every: int = 1000,
                 checkpoint_every: int = 0) -> None:
    """`checkpoint_every`: the job's --checkpoint-steps, the steps each shard cuts itself at (cuts.py)."""
    os.makedirs(directory, exist_ok=True)
    config = {"tables": [s.to_json() for s in specs], "routing": routing.to_json(), "snapshot_every": snapshot_every,
              "checkpoint_every": checkpoint_every}
    with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(config, f)


class ShardProcess:
    def __init__(self, directory: str, shard: int, token_file: str, host: str = "127.0.0.1", fsync: bool = True):
        self.directory, self.shard, self.token_file, self.host, self.fsync = directory, shard, token_file, host, fsync
        self.process: subprocess.Popen | None = None

    def start(self, port: int = 0) -> None:
        """Launch the shard; `port` 0 lets it pick one (ready.json says which), a relaunch passes
        its old one so that clients' routes stay right."""
        command = [sys.executable, "-m", "elastic_step.ps.shard", "--dir", self.directory, "--shard", str(self.shard)]
        command += ["--host", self.host, "--port", str(port), "--token-file", self.token_file]
        command += [] if self.fsync else ["--no-fsync"]
        self.process = subprocess.Popen(command)

    def ready(self) -> dict | None:
        """The shard's ready.json once this launch wrote it, else None."""
        try:
            with open(os.path.join(self.directory, READY_FILE), encoding="utf-8") as f:
                info = json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return info if self.process is not None and info["pid"] == self.process.pid else None

    def wait_ready(self, timeout_s: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while (info := self.ready()) is None:
            if self.process.poll() is not None:
                raise RuntimeError(f"shard {self.shard} exited with code {self.process.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise TimeoutError(f"shard {self.shard} not ready after {timeout_s:.0f} s")
            time.sleep(0.02)
        return info

    @property
    def endpoint(self) -> str:
        info = self.ready()
        return f"{info['host']}:{info['port']}" if info else f"{self.host}:1"  # port 1: refused at once

    def kill(self, sig: int) -> int:
        self.process.send_signal(sig)
        return self.process.wait(timeout=30)


class LocalShards:
    """N shard processes under one routing table."""

    def __init__(self, root: str, specs: list[TableSpec], shards: int, token_file: str, snapshot_every: int = 1000, fsync: bool = True,
                 routing: RoutingTable | None = None, checkpoint_every: int = 0):
        self.root, self.specs, self.token_file, self.snapshot_every, self.fsync = root, specs, token_file, snapshot_every, fsync
        self.checkpoint_every = checkpoint_every
        self.routing = routing or RoutingTable.initial(shards)  # a resumed job's: that of its last scale --ps
        self.shards: list[ShardProcess] = []
        for index in range(shards):
            self.shards.append(self._new_shard(index))

    def _new_shard(self, index: int, fresh: bool = False) -> ShardProcess:
        directory = os.path.join(self.root, f"shard-{index}")
        if fresh:  # a shard added by a resize: nothing of an earlier one that had its index
            shutil.rmtree(directory, ignore_errors=True)
        write_config(directory, self.specs, self.routing, self.snapshot_every, self.checkpoint_every)
        return ShardProcess(directory, index, self.token_file, fsync=self.fsync)

    def resize(self, shards: int, call: Callable[..., tuple[dict, bytearray]]) -> MoveReport:
        """Run `shards` processes from now on, moving only the virtual shards that change owner
        (moves.py) while clients go on. `call(endpoint, header, *arrays)` asks one shard. Added
        shards start empty under the current routing; removed ones (the highest indices) are
        stopped once they gave everything away, and leave the list first, so that a supervisor
        does not relaunch them."""
        added = [self._new_shard(index, fresh=True) for index in range(len(self.shards), shards)]
        try:
            for shard in added:
                shard.start()
            for shard in added:
                shard.wait_ready()
        except (OSError, RuntimeError) as exc:  # TimeoutError is an OSError  # nothing has moved: the added ones go, none left behind
            for shard in added:
                if shard.process is not None and shard.process.poll() is None:
                    shard.kill(signal.SIGKILL)
            raise ShardsNotStarted(f"an added shard did not start: {exc}") from exc
        everyone = self.shards + added
        resized = self.routing.resized(shards, [s.endpoint for s in everyone[:shards]])
        try:
            report = move(lambda i, *request: call(everyone[i].endpoint, *request), self.routing, resized)
        except BaseException:
            self.shards = everyone  # stopped with the others at the end (a resume finishes the move)
            raise
        self.routing = resized
        self.shards = everyone[:shards]
        for shard in everyone[shards:]:
            shard.kill(signal.SIGTERM)
        return report

    def start(self) -> None:
        for shard in self.shards:
            shard.start()
        for shard in self.shards:
            shard.wait_ready()

    def routes(self) -> RoutingTable:
        return RoutingTable(self.routing.epoch, self.routing.owners, [s.endpoint for s in self.shards])

    def stop(self) -> None:
        for shard in self.shards:
            if shard.process is not None and shard.process.poll() is None:
                shard.process.kill()
                shard.process.wait()


def saved_routings(root: str) -> list[dict]:
    """Each shard folder's routing.json under `root` (what its shard adopted last), by index."""
    found = []
    for name in sorted(os.listdir(root) if os.path.isdir(root) else [], key=lambda n: (len(n), n)):
        try:
            with open(os.path.join(root, name, ROUTING_FILE), encoding="utf-8") as f:
                found.append(json.load(f))
        except (FileNotFoundError, json.JSONDecodeError, NotADirectoryError):
            continue
    return found


def routes_from(directories: list[str], routing: RoutingTable) -> RoutingTable:
    """`routing` with each shard's address as its folder's ready.json says (a shard not ready
    yet gets an address that refuses at once, for the client to retry)."""
    endpoints = []
    for directory in directories:
        try:
            with open(os.path.join(directory, READY_FILE), encoding="utf-8") as f:
                info = json.load(f)
            endpoints.append(f"{info['host']}:{info['port']}")
        except (FileNotFoundError, json.JSONDecodeError):
            endpoints.append("127.0.0.1:1")
    return RoutingTable(routing.epoch, routing.owners, endpoints)
