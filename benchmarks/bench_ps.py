"""Parameter-server shards: bytes per row, pull+push rows/s, the ledger's cost, SIGKILL recovery.

1. Bytes per row of a dim-16 Adagrad table (128 bytes of payload: weights and accumulator) at
   --rows rows: elastic-step's EmbeddingTable (with its declared capacity, and grown from empty),
   beside a dict of numpy arrays (id -> one float32 array of 32) measured at --dict-rows rows
   (its bytes per row do not depend on the count; stated as such). Each is built in a fresh
   process and measured as its RSS growth, besides the bytes the table accounts for.
2. Pull + push rows/s of one client against one local shard process (Zipf ids, deduplicated),
   with the fsync'd ledger and without it (--no-fsync): the ledger's cost; the same with the
   pushes through a PushQueue (the next pull overlaps the last push's fsync); and the same
   ShardState in-process, without the network.
3. SIGKILL -> first successful pull: a shard holding --kill-rows rows (snapshot + a ledger tail of
   pushes) is killed --kills times; the time from the kill until a client's pull succeeds
   (relaunch, snapshot load, ledger replay, reconnect), and the table hash before and after.
4. A table larger than a worker (`--big-rows`, e.g. 40M rows of dim 16 + Adagrad, 5.1 GB of
   payload, over `--big-shards` local shard processes): every row made by a pull from one client
   process, as a PS-mode worker pulls a batch's rows; each shard process's peak RSS (VmHWM) beside
   the client's, which holds a batch's rows at a time and never the table.

    .venv/bin/python benchmarks/bench_ps.py --rows 10000000 --kill-rows 2500000 --kills 5
    .venv/bin/python benchmarks/bench_ps.py --only-big --big-rows 40000000 --big-shards 4
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import machine  # noqa: E402

from elastic_step.ps.api import OptimizerKind, TableSpec  # noqa: E402
from elastic_step.ps.client import PsClient, PushQueue  # noqa: E402
from elastic_step.ps.ledger import LedgerRecord  # noqa: E402
from elastic_step.ps.local import LocalShards  # noqa: E402
from elastic_step.ps.routing import RoutingTable  # noqa: E402
from elastic_step.ps.state import ShardState  # noqa: E402
from elastic_step.ps.table import EmbeddingTable  # noqa: E402

TOKEN = "bench-token"
PAYLOAD = 2 * 16 * 4


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def spread_ids(begin: int, end: int, declared: int = 0) -> np.ndarray:
    """Ids begin..end-1 spread out (times a prime), as hashed ids are; inside [0, declared) for a
    declared table (a permutation of it: the prime does not divide the counts used here)."""
    ids = np.arange(begin, end, dtype=np.int64) * 7919
    return ids % declared if declared else ids


def fill(table: EmbeddingTable, rows: int) -> float:
    start = time.perf_counter()
    for begin in range(0, rows, 100_000):
        table.pull(spread_ids(begin, min(rows, begin + 100_000), table.spec.rows))
    return time.perf_counter() - start


def measure(kind: str, rows: int) -> None:
    """In a fresh process: RSS growth per row of one structure (and its accounted bytes)."""
    before = rss()
    start = time.perf_counter()
    if kind == "dict":
        held = {i * 7919: np.zeros(32, np.float32) for i in range(rows)}
        accounted = 0
    else:
        declared = rows if kind == "declared" else 0  # a declared table's shard reserves its share up front
        held = EmbeddingTable(TableSpec("t", 16, OptimizerKind.ADAGRAD, rows=declared), reserve=declared)
        fill(held, rows)
        accounted = held.nbytes
    seconds = time.perf_counter() - start
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand back the freed temporaries of the fill
    print(json.dumps({"rss": (rss() - before) / rows, "accounted": accounted / rows, "rate": rows / seconds}))


def bytes_per_row(rows: int, dict_rows: int) -> None:
    labels = {"declared": "EmbeddingTable, declared capacity", "grown": "EmbeddingTable, grown from empty", "dict": "dict of numpy arrays"}
    for kind, count in (("declared", rows), ("grown", rows), ("dict", dict_rows)):
        out = subprocess.run([sys.executable, __file__, "--measure", kind, "--rows", str(count)], capture_output=True, text=True, check=True)
        figures = json.loads(out.stdout)
        held = f"{figures['accounted']:.1f} B/row held ({figures['accounted'] / PAYLOAD:.2f}x), " if figures["accounted"] else ""
        print(f"  {labels[kind]} at {count:,} rows: {held}RSS +{figures['rss']:.1f} B/row ({figures['rss'] / PAYLOAD:.2f}x payload); "
              f"{figures['rate'] / 1e6:.2f} M rows/s created")


def zipf_batches(count: int, batch: int, rows: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [np.unique(rng.zipf(1.2, batch) % rows) for _ in range(count)]


def throughput(root: str, token_file: str, fsync: bool, batches: list[np.ndarray], queued: bool = False) -> float:
    """Rows/s of pull + push; `queued`: pushes go through a PushQueue (the next pull overlaps
    the last push's fsync), as a worker that computes while its push is made durable."""
    folder = os.path.join(root, f"rate-{fsync}-{queued}")
    shards = LocalShards(folder, [TableSpec("t", 16)], 1, token_file, snapshot_every=10**9, fsync=fsync)
    shards.start()
    try:
        client = PsClient(TOKEN, shards.routes)
        pushes = PushQueue(PsClient(TOKEN, shards.routes)) if queued else None
        client.pull("t", batches[0])  # connect, warm up
        start = time.perf_counter()
        for seq, ids in enumerate(batches):
            rows = client.pull("t", ids)
            if pushes:
                pushes.submit("t", 0, seq, 0, ids, rows * 0.01)
            else:
                client.push("t", 0, seq, 0, ids, rows * 0.01)
        if pushes:
            pushes.wait()
            pushes.close()
        return sum(len(b) for b in batches) / (time.perf_counter() - start)
    finally:
        shards.stop()


def in_process(root: str, batches: list[np.ndarray]) -> float:
    os.makedirs(os.path.join(root, "inproc"))
    state = ShardState(os.path.join(root, "inproc"), [TableSpec("t", 16)], 0, RoutingTable.initial(1), snapshot_every=10**9)
    state.recover()
    try:
        start = time.perf_counter()
        for seq, ids in enumerate(batches):
            rows = state.pull("t", ids)
            state.push(LedgerRecord("t", 0, seq, 0, ids, rows * 0.01))
        return sum(len(b) for b in batches) / (time.perf_counter() - start)
    finally:
        state.close()  # its ledger's file and fsync thread, not kept for the rest of the bench


def kill_recovery(root: str, token_file: str, rows: int, kills: int) -> None:
    spec = TableSpec("t", 16, rows=rows)  # declared: the one shard reserves it (sizing.reserved_rows)
    shards = LocalShards(os.path.join(root, "kill"), [spec], 1, token_file, snapshot_every=10**9)
    shards.start()
    shard, client = shards.shards[0], PsClient(TOKEN, shards.routes)
    try:
        for begin in range(0, rows, 250_000):
            client.pull("t", np.arange(begin, min(rows, begin + 250_000)))
        start = time.perf_counter()
        client.call(shard.endpoint, {"op": "snapshot"})
        print(f"  snapshot of {rows:,} rows: {time.perf_counter() - start:.2f} s")
        times, seq = [], 0
        for _ in range(kills):
            for ids in zipf_batches(200, 4096, rows, seed=seq):  # a ledger tail to replay
                client.push("t", 1, seq, 0, ids, np.full((len(ids), 16), 0.01, np.float32))
                seq += 1
            digest = client.call(shard.endpoint, {"op": "digest", "table": "t"})[0]["digest"]
            killed = time.perf_counter()
            shard.kill(signal.SIGKILL)
            shard.start()
            client.pull("t", np.arange(10))  # retried until the relaunched shard answers
            times.append(time.perf_counter() - killed)
            after = client.call(shard.endpoint, {"op": "digest", "table": "t"})[0]["digest"]
            ready = shard.ready()
            print(f"  kill: first pull after {times[-1]:.2f} s (snapshot load {ready['load_s']:.2f} s, replay of {ready['replayed']} pushes "
                  f"{ready['replay_s']:.2f} s), table hash equal to before the kill: {after == digest}")
        p95 = sorted(times)[max(0, int(np.ceil(0.95 * len(times))) - 1)]
        print(f"  SIGKILL -> first pull over {kills} kills: median {statistics.median(times):.2f} s, p95 {p95:.2f} s, max {max(times):.2f} s")
    finally:
        shards.stop()


def peak_rss(pid: int | str = "self") -> int:
    """A process's peak resident set (VmHWM), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def table_no_worker_holds(root: str, token_file: str, rows: int, shards: int, batch: int = 250_000) -> None:
    """Every one of `rows` ids pulled once (a pull makes a row), from this process, over `shards`
    shard processes of a table declared with `rows` rows, each reserving its share (with the
    room sizing.RESERVE_SLACK gives for the hash's imbalance); then each one's peak RSS and ours."""
    spec = TableSpec("t", 16, OptimizerKind.ADAGRAD, rows=rows)
    local = LocalShards(os.path.join(root, "big"), [spec], shards, token_file, snapshot_every=10**9, fsync=False)
    local.start()
    client = PsClient(TOKEN, local.routes)
    try:
        start = time.perf_counter()
        for begin in range(0, rows, batch):
            client.pull("t", spread_ids(begin, min(rows, begin + batch), rows))
        seconds = time.perf_counter() - start
        held = [client.call(s.endpoint, {"op": "stats"})[0] for s in local.shards]
        peaks = [peak_rss(s.process.pid) for s in local.shards]
        print(f"  {rows:,} rows made in {seconds:.0f} s ({rows / seconds:,.0f} rows/s), {rows * PAYLOAD / 2**30:.2f} GiB of payload")
        for s, stats, peak in zip(local.shards, held, peaks):
            print(f"  shard {s.shard}: {stats['tables']['t']['rows']:,} rows, peak RSS {peak / 2**30:.2f} GiB")
        print(f"  the client (a worker's pulls, {batch:,} rows at a time): peak RSS {peak_rss() / 2**30:.2f} GiB")
    finally:
        client.close()
        for s in local.shards:  # SIGKILL: a shard stopped with SIGTERM would first write a snapshot of its rows
            s.kill(signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows for the bytes-per-row figure")
    parser.add_argument("--dict-rows", type=int, default=1_000_000, help="rows for the dict-of-arrays peer")
    parser.add_argument("--batches", type=int, default=300, help="pull+push batches for the rate")
    parser.add_argument("--batch", type=int, default=4096, help="ids drawn per batch (deduplicated)")
    parser.add_argument("--kill-rows", type=int, default=1_000_000)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--big-rows", type=int, default=0, help="rows of the table no worker holds (section 4; 0: skip)")
    parser.add_argument("--big-shards", type=int, default=4)
    parser.add_argument("--only-big", action="store_true", help="section 4 alone")
    parser.add_argument("--measure", choices=["declared", "grown", "dict"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        return measure(args.measure, args.rows)
    print(f"bench_ps on {machine()}")
    if args.only_big:
        with tempfile.TemporaryDirectory() as root:
            token_file = os.path.join(root, "token")
            with open(token_file, "w") as f:
                f.write(TOKEN)
            print(f"4. a table no worker holds: {args.big_rows:,} rows, dim 16 + Adagrad, {args.big_shards} shards")
            table_no_worker_holds(root, token_file, args.big_rows, args.big_shards)
        return None
    print(f"1. bytes per row, dim 16 + Adagrad ({PAYLOAD} B payload), {args.rows:,} rows")
    bytes_per_row(args.rows, args.dict_rows)
    with tempfile.TemporaryDirectory() as root:
        token_file = os.path.join(root, "token")
        with open(token_file, "w") as f:
            f.write(TOKEN)
        batches = zipf_batches(args.batches, args.batch, 1_000_000)
        print(f"2. pull + push, one client, one local shard, {args.batches} batches of {np.mean([len(b) for b in batches]):.0f} distinct ids, dim 16 Adagrad")
        synced = throughput(root, token_file, True, batches)
        unsynced = throughput(root, token_file, False, batches)
        print(f"  with the fsync'd ledger: {synced:,.0f} rows/s; without fsync: {unsynced:,.0f} rows/s; ledger cost {1 - synced / unsynced:.1%}")
        queued_synced = throughput(root, token_file, True, batches, queued=True)
        queued_unsynced = throughput(root, token_file, False, batches, queued=True)
        print(f"  pushes through a PushQueue (depth 2): fsync'd {queued_synced:,.0f} rows/s; without fsync: {queued_unsynced:,.0f} rows/s; "
              f"ledger cost {1 - queued_synced / queued_unsynced:.1%}")
        print(f"  in-process ShardState (fsync'd ledger, no network): {in_process(root, batches):,.0f} rows/s")
        print(f"3. SIGKILL recovery, {args.kill_rows:,} rows")
        kill_recovery(root, token_file, args.kill_rows, args.kills)
        if args.big_rows:
            print(f"4. a table no worker holds: {args.big_rows:,} rows, dim 16 + Adagrad, {args.big_shards} shards")
            table_no_worker_holds(root, token_file, args.big_rows, args.big_shards)


if __name__ == "__main__":
    main()
