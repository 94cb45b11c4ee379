"""Exactly once on real shard processes, under real signals.

(a) Workers push batches as (task, batch_seq, attempt); some pushes are sent twice, and a worker
process SIGKILLed mid-task has its task re-issued to another process with a new attempt. The
shards' per-row update counters equal a clean run's, computed from the data alone.
(b) A shard SIGKILLed mid-stream (twice) and relaunched from its snapshot and ledger tail loses no
acknowledged update: the client retries what was not acknowledged, nothing is applied twice,
and every shard's table hash equals an in-process replay of the same pushes.

Run as a script, this file is the worker process of (a).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from collections import Counter

import numpy as np
import pytest

from elastic_step.ps.api import OptimizerKind, TableSpec
from elastic_step.ps.client import PsClient
from elastic_step.ps.local import LocalShards, routes_from
from elastic_step.ps.routing import RoutingTable
from elastic_step.ps.table import EmbeddingTable

TOKEN = "ps-test-token"
SPEC = TableSpec("emb", 8, OptimizerKind.ADAGRAD, lr=0.05)


def batch(task: int, batch_seq: int) -> tuple[np.ndarray, np.ndarray]:
    """The data generator: a batch's ids (Zipf-distributed, repeats included) and gradients."""
    rng = np.random.default_rng([task, batch_seq])
    ids = rng.zipf(1.3, 64) % 3000
    return ids, rng.normal(size=(64, SPEC.dim)).astype(np.float32)


def clean_counters(tasks: dict[int, int]) -> Counter:
    """Per-row update counts of a clean run: each batch updates each of its distinct ids once."""
    counts = Counter()
    for task, batches in tasks.items():
        for b in range(batches):
            counts.update(np.unique(batch(task, b)[0]).tolist())
    return counts


def shard_counters(client: PsClient, shards: LocalShards) -> Counter:
    counts = Counter()
    for shard in shards.shards:
        header, body = client.call(shard.endpoint, {"op": "counters", "table": SPEC.name})
        ids = np.frombuffer(body, "<i8", count=header["count"])
        updates = np.frombuffer(body, "<u4", offset=8 * header["count"])
        counts.update({i: u for i, u in zip(ids.tolist(), updates.tolist()) if u})
    return counts


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN)
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def shards(tmp_path, token_file):
    started = LocalShards(str(tmp_path / "ps"), [SPEC], 2, token_file, snapshot_every=16)
    started.start()
    yield started
    started.stop()


def worker(shards: LocalShards, token_file: str, task: int, attempt: int, batches: int, twice_every: int = 0):
    command = [sys.executable, __file__, "--root", os.path.dirname(shards.shards[0].directory), "--token-file", token_file]
    command += ["--task", str(task), "--attempt", str(attempt), "--batches", str(batches), "--twice-every", str(twice_every)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)


def test_resent_and_reissued_pushes_count_once(shards, token_file):
    resender = worker(shards, token_file, task=0, attempt=0, batches=40, twice_every=3)
    doomed = worker(shards, token_file, task=1, attempt=0, batches=400)
    for _ in range(5):  # let it push a few batches, then kill it mid-task
        assert doomed.stdout.readline().startswith("acked")
    doomed.send_signal(signal.SIGKILL)
    acked_before_death = 5 + sum(1 for line in doomed.stdout if line.startswith("acked"))
    assert doomed.wait() == -signal.SIGKILL and acked_before_death < 400

    reissued = worker(shards, token_file, task=1, attempt=1, batches=400)
    out, _ = reissued.communicate(timeout=120)
    assert reissued.returncode == 0
    assert int(out.split("duplicate=")[1].split()[0]) >= acked_before_death  # its earlier pushes were not applied again
    out, _ = resender.communicate(timeout=120)
    assert resender.returncode == 0
    assert int(out.split("duplicate=")[1].split()[0]) >= 14  # batches 0, 3, ..., 39, each sent twice

    client = PsClient(TOKEN, shards.routes)
    assert shard_counters(client, shards) == clean_counters({0: 40, 1: 400})


def reference_digests(routing: RoutingTable, pushes: list[tuple[np.ndarray, np.ndarray]]) -> list[str]:
    """Each shard's table after the pushes, applied once each, in order, in this process."""
    tables = [EmbeddingTable(SPEC) for _ in range(routing.shards)]
    for ids, grads in pushes:
        unique, inverse = np.unique(ids, return_inverse=True)
        merged = np.zeros((len(unique), SPEC.dim), np.float32)
        np.add.at(merged, inverse, grads)  # as the client merges
        owner = routing.shard_of(unique)
        for shard, table in enumerate(tables):
            table.push(unique[owner == shard], merged[owner == shard])
    return [t.digest() for t in tables]


def test_a_killed_shard_loses_no_acknowledged_update(shards):
    client = PsClient(TOKEN, shards.routes)
    first = shards.shards[0]
    # An update the shard applied whose acknowledgement the worker never saw (the reply is read
    # here only to know the shard got it): after a SIGKILL the worker re-sends it.
    ids, grads = batch(7, 0)
    owned = np.unique(ids)[shards.routing.shard_of(np.unique(ids)) == 0]
    raw = client.call(first.endpoint, {"op": "push", "table": SPEC.name, "epoch": 1, "task": 7, "batch_seq": 0, "attempt": 0, "count": len(owned)}, owned, np.zeros((len(owned), SPEC.dim), np.float32) + 1)
    assert raw[0]["applied"] is True
    first.kill(signal.SIGKILL)
    first.start()
    assert first.wait_ready()["replayed"] == 1
    merged_once = np.zeros((len(owned), SPEC.dim), np.float32) + 1
    reply = client.push(SPEC.name, 7, 0, 1, owned, merged_once)
    assert (reply.applied, reply.duplicate) == (0, 1)

    pushes, kill_at = [(owned, merged_once)], {40: threading.Event(), 100: threading.Event()}
    killer = threading.Thread(target=kill_and_relaunch, args=(first, list(kill_at.values())))
    killer.start()
    try:
        for b in range(1, 150):
            pushes.append(batch(7, b))
            client.push(SPEC.name, 7, b, 0, *pushes[-1])  # retried inside until acknowledged
            if b in kill_at:
                kill_at[b].set()
    finally:
        for moment in kill_at.values():
            moment.set()
        killer.join()
    assert first.process.poll() is None
    digests = [client.call(s.endpoint, {"op": "digest", "table": SPEC.name})[0]["digest"] for s in shards.shards]
    assert digests == reference_digests(shards.routing, pushes)


def kill_and_relaunch(shard, moments: list[threading.Event]) -> None:
    """The master's part: SIGKILL the shard while pushes are in flight, relaunch it."""
    for moment in moments:
        moment.wait(timeout=120)
        shard.kill(signal.SIGKILL)
        shard.start()
        shard.wait_ready()


def worker_main() -> None:
    """Push a task's batches; print each acknowledgement (the test kills this mid-task)."""
    parser = argparse.ArgumentParser()
    for name in ("--root", "--token-file"):
        parser.add_argument(name, required=True)
    for name in ("--task", "--attempt", "--batches", "--twice-every"):
        parser.add_argument(name, type=int, required=True)
    args = parser.parse_args()
    directories = sorted(os.path.join(args.root, d) for d in os.listdir(args.root) if d.startswith("shard-"))
    routing = RoutingTable.initial(len(directories))
    with open(args.token_file, encoding="utf-8") as f:
        client = PsClient(f.read().strip(), lambda: routes_from(directories, routing))
    duplicates = 0
    for b in range(args.batches):
        sends = 2 if args.twice_every and b % args.twice_every == 0 else 1
        for _ in range(sends):
            duplicates += client.push(SPEC.name, args.task, b, args.attempt, *batch(args.task, b)).duplicate
        print(f"acked {b}", flush=True)
    print(f"done duplicate={duplicates} ", flush=True)


if __name__ == "__main__":
    worker_main()
