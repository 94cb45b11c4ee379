"""Sparse training rows/s: DeepFM on elastic-step's parameter-server shards beside plain PyTorch.

The same model (model_zoo/deepfm_ps_torch's DeepFM: 26 categorical fields in one table whose row
is [first-order weight | 8 factors], 13 dense features with missing flags, an MLP), the same
batches (Zipf ids over --ids rows, as click logs have them), the same optimizers (Adagrad at
0.05 on the table, Adam at 2e-3 on the dense weights), one process computing:

- peer: single-process PyTorch as its users write it, the whole table in the process as
  `nn.Embedding(ids, 9, sparse=True)` with torch.optim.Adagrad (sparse gradients);
- ours: the table on --shards local shard processes (PsEmbedding pulls a batch's distinct ids,
  the gradient merged per id is pushed with its key and applied by the shard's Adagrad), with
  the fsync'd ledger and without it (the ledger's cost); and with the shards' state in this
  process (no processes, no network: what the table code itself costs).

What is measured is one training process's steps (forward, backward, pull, push, optimizer), not
a whole job (no master, no allreduce: the step a PS-mode worker runs, alone).

The variants run interleaved (`interleaved`: the machine's drift hits them alike), so all five
tables are held at once: about five times one table's memory (rows and optimizer slots, in this
process and the shard processes). `--one-at-a-time` builds, measures and releases one variant
after the other instead (their order rotating by repeat), holding one table at a time, for an
--ids too large for five; its figures are then taken minutes apart, exposed to that drift.

`--scale` (or `--scale-only`): the same steps on --shards shard processes, resized to
--shards + 1 midway (what `scale --ps` does: ps/moves.py) while the steps go on: the rows moved
of the rows held (target <= 1/N + 5%), how long a moved virtual shard was refused, the longest
step the training process saw during the move, and that the step count's pushes all landed.

    .venv/bin/python benchmarks/bench_sparse.py --ids 1000000 --batches 200 --batch 512 --repeats 3
    .venv/bin/python benchmarks/bench_sparse.py --scale-only --ids 1000000 --batches 300
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from typing import Callable

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import machine  # noqa: E402

from elastic_step.allocator import keep_step_memory  # noqa: E402
from elastic_step.model_zoo.deepfm_ps_torch import TABLE, TABLE_LR, DeepFM  # noqa: E402
from elastic_step.ps.arrays import put_rows  # noqa: E402
from elastic_step.ps.client import PsClient  # noqa: E402
from elastic_step.ps.ledger import LedgerRecord  # noqa: E402
from elastic_step.ps.local import LocalShards  # noqa: E402
from elastic_step.ps.routing import RoutingTable  # noqa: E402
from elastic_step.ps.state import ShardState  # noqa: E402
from elastic_step.ps.torch_embedding import ps_tables  # noqa: E402

FIELDS, DENSE = 26, 13
VARIANTS = ("ours", "unsynced", "in_process", "in_process_unsynced", "peer")  # as print_rates names them
BLOCK = 20  # steps a variant runs in one turn (interleaved)
TOKEN = "bench-token"


def batches(count: int, batch: int, ids: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Packed rows as ctr_features.feed makes them: 26 ids, then log1p counts and missing flags."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        field_ids = (rng.zipf(1.2, (batch, FIELDS)) + np.arange(FIELDS) * 7919) % ids
        counts = rng.lognormal(1.0, 1.5, (batch, DENSE))
        missing = rng.random((batch, DENSE)) < 0.2
        dense = np.concatenate([np.log1p(np.where(missing, 0, counts)), missing], axis=1)
        labels = (rng.random(batch) < 0.25).astype(np.float32)
        out.append((torch.from_numpy(np.concatenate([field_ids, dense], axis=1)), torch.from_numpy(labels)))
    return out


def dense_optimizer(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam([p for name, p in net.named_parameters() if not name.startswith("table.")], lr=2e-3)


@contextlib.contextmanager
def peer_step(ids: int):
    """Single-process PyTorch: the whole table in this process, sparse gradients, Adagrad."""
    torch.manual_seed(0)
    net = DeepFM(FIELDS, 2 * DENSE)
    net.table = nn.Embedding(ids, 9, sparse=True)
    nn.init.uniform_(net.table.weight, -0.01, 0.01)
    dense, sparse = dense_optimizer(net), torch.optim.Adagrad([net.table.weight], lr=TABLE_LR)

    def step(x, y):
        dense.zero_grad()
        sparse.zero_grad()
        nn.functional.binary_cross_entropy_with_logits(net(x), y).backward()
        dense.step()
        sparse.step()

    yield step


@contextlib.contextmanager
def ps_step(root: str, token_file: str, shards: int, fsync: bool, ids: int):
    """The table on `shards` local shard processes: pull, compute, push merged per id, Adam."""
    torch.manual_seed(0)
    net = DeepFM(FIELDS, 2 * DENSE, rows=ids)  # the table's size, as the peer's nn.Embedding has it
    table = ps_tables(net)[0]
    started = LocalShards(os.path.join(root, f"shards-{fsync}"), [table.spec], shards, token_file,
                          snapshot_every=10**9, fsync=fsync)
    started.start()
    client = None
    try:
        client = PsClient(TOKEN, started.routes)
        table.source = partial(client.pull, TABLE)
        dense = dense_optimizer(net)
        seq = iter(range(10**9))

        def step(x, y):
            dense.zero_grad()
            table.forget()
            nn.functional.binary_cross_entropy_with_logits(net(x), y).backward()
            pushed_ids, grads = table.take_gradients()
            client.push(TABLE, 0, next(seq), 0, pushed_ids, grads)
            dense.step()

        yield step
    finally:
        if client is not None:
            client.close()
        started.stop()


@contextlib.contextmanager
def in_process_step(root: str, shards: int, ids: int, fsync: bool = True):
    """The same step with the shards' state in this process (ShardState, its ledger fsync'd or
    not): the cost of the table's own code, without the processes and the network. Each shard's part of a
    pull and a push is served in turn; each shard's fsync of a push runs on its ledger's thread
    from the moment its record is written, so the shards' fsyncs run side by side, as shard
    processes run them (a thread per shard for the rest too was measured slower: the threads'
    numpy and Python wait on the GIL, which an fsync does not hold)."""
    torch.manual_seed(0)
    net = DeepFM(FIELDS, 2 * DENSE, rows=ids)  # the table's size, as the peer's nn.Embedding has it
    table = ps_tables(net)[0]
    routing = RoutingTable.initial(shards)
    states = []
    for index in range(shards):
        folder = os.path.join(root, f"inproc-{fsync}-{index}")
        os.makedirs(folder)
        states.append(ShardState(folder, [table.spec], index, routing, snapshot_every=10**9, sync=fsync))
        states[-1].recover()

    def each_shard(ids):
        """Each shard that owns some of `ids`, with their positions (as the client asks only those)."""
        owner = routing.shard_of(ids)
        parts = [(state, np.flatnonzero(owner == index)) for index, state in enumerate(states)]
        return [(state, at) for state, at in parts if len(at)]

    def pull(ids):
        rows = np.empty((len(ids), table.spec.dim), np.float32)
        for state, at in each_shard(ids):
            put_rows(rows, at, state.pull(TABLE, ids[at]))  # as the client does
        return rows

    table.source = pull
    dense, seq = dense_optimizer(net), iter(range(10**9))

    def step(x, y):
        dense.zero_grad()
        table.forget()
        nn.functional.binary_cross_entropy_with_logits(net(x), y).backward()
        pushed_ids, grads = table.take_gradients()
        key = next(seq)
        marks = [(state, state.accept(LedgerRecord(TABLE, 0, key, 0, pushed_ids[at], grads[at]))[1])
                 for state, at in each_shard(pushed_ids)]
        for state, mark in marks:
            state.ledger.sync_through(mark)
        dense.step()

    try:
        yield step
    finally:
        for state in states:
            state.close()


def scale_figure(data, root: str, token_file: str, shards: int, ids: int) -> dict:
    """Train on `shards` shard processes and resize them to shards + 1 once a third of the steps
    ran, the steps going on meanwhile on this thread's client."""
    import threading

    torch.manual_seed(0)
    net = DeepFM(FIELDS, 2 * DENSE, rows=ids)  # the table's size, as the peer's nn.Embedding has it
    table = ps_tables(net)[0]
    started = LocalShards(os.path.join(root, "scaled"), [table.spec], shards, token_file, snapshot_every=10**9)
    started.start()
    try:
        first = started.routes()
        client = PsClient(TOKEN, lambda: first)  # learns the next routing from the shards, as a worker does
        table.source = partial(client.pull, TABLE)
        dense, moving, times = dense_optimizer(net), threading.Event(), []
        report: dict = {}

        def resize():
            admin = PsClient(TOKEN, lambda: None, timeout_s=120.0)
            report.update(started.resize(shards + 1, admin.call).to_json())
            admin.close()

        mover = threading.Thread(target=resize)
        for seq, (x, y) in enumerate(data):
            if seq == len(data) // 3:
                moving.set()
                mover.start()
            begun, alive = time.perf_counter(), mover.is_alive()
            dense.zero_grad()
            table.forget()
            nn.functional.binary_cross_entropy_with_logits(net(x), y).backward()
            pushed_ids, grads = table.take_gradients()
            client.push(TABLE, 0, seq, 0, pushed_ids, grads)
            dense.step()
            times.append((alive or mover.is_alive(), time.perf_counter() - begun))  # a step the move overlapped
        mover.join()
        during = [t for alive, t in times if alive] or [0.0]
        report.update(longest_step_during_s=max(during), median_step_s=float(np.median([t for _, t in times])),
                      steps_during=len(during), epoch_seen=client.routing.epoch)
        client.close()
        return report
    finally:
        started.stop()


def interleaved(steps: dict[str, Callable], data, block: int = BLOCK, warm_up: int = 5) -> dict[str, float]:
    """Each variant's rows/s over the same batches, run in turns of `block` steps (each variant
    trains its own model on every batch, in order; the first to go rotates every turn): this
    machine's speed drifts by a third within minutes, and turns of a fraction of a second put
    every variant through the same minutes, where runs one after the other did not."""
    for step in steps.values():
        for x, y in data[:warm_up]:
            step(x, y)
    spent = dict.fromkeys(steps, 0.0)
    names = list(steps)
    for turn, start in enumerate(range(warm_up, len(data), block)):
        for name in names[turn % len(names):] + names[: turn % len(names)]:
            began = time.perf_counter()
            for x, y in data[start : start + block]:
                steps[name](x, y)
            spent[name] += time.perf_counter() - began
    rows = sum(len(y) for _, y in data[warm_up:])
    return {name: rows / seconds for name, seconds in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ids", type=int, default=1_000_000, help="rows of the table (Zipf ids over them)")
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--batch", type=int, default=512, help="rows per step")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the same for both)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every variant, each run interleaving them (medians printed)")
    parser.add_argument("--scale", action="store_true", help="also resize the shards to --shards + 1 midway (scale --ps)")
    parser.add_argument("--scale-only", action="store_true", help="only the resize figure")
    parser.add_argument("--one-at-a-time", action="store_true",
                        help="build, measure and release the variants one after the other, holding one table at a time "
                             "instead of five (for a large --ids), rather than interleaved")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # This process trains as a PS-mode worker does, with its malloc settings (allocator.py); the
    # peer, run in this process too, gets them as well (its users' default glibc is slower).
    keep_step_memory()
    torch.sparse.check_sparse_tensor_invariants.disable()  # the peer's default, said out loud (no warning)
    print(f"bench_sparse on {machine()}")
    print(f"DeepFM, {FIELDS} fields over a table of {args.ids:,} ids x 9, batches of {args.batch}, {args.batches} steps, "
          f"{args.threads} torch thread(s)" + (", the variants one at a time (not interleaved)" if args.one_at_a_time else ""))
    data = batches(args.batches, args.batch, args.ids)
    with tempfile.TemporaryDirectory() as root:
        token_file = os.path.join(root, "token")
        with open(token_file, "w") as f:
            f.write(TOKEN)
        if args.scale or args.scale_only:
            print_scale(scale_figure(data, root, token_file, args.shards, args.ids), args.shards)
        if args.scale_only:
            return
        runs: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for repeat in range(args.repeats):
            folder = os.path.join(root, f"repeat-{repeat}")
            os.makedirs(folder)
            if args.one_at_a_time:
                for name in VARIANTS[repeat % len(VARIANTS):] + VARIANTS[: repeat % len(VARIANTS)]:
                    runs[name].append(alone(name, data, folder, token_file, args))
                continue
            with contextlib.ExitStack() as variants:
                steps = {name: variants.enter_context(variant(name, folder, token_file, args)) for name in VARIANTS}
                for name, rate in interleaved(steps, data).items():
                    runs[name].append(rate)
    print_rates(runs, args.shards)


def variant(name: str, folder: str, token_file: str, args) -> contextlib.AbstractContextManager[Callable]:
    """Variant `name`'s step, its table built on entry and released on exit."""
    if name == "ours" or name == "unsynced":
        return ps_step(folder, token_file, args.shards, name == "ours", args.ids)
    if name == "in_process" or name == "in_process_unsynced":
        return in_process_step(folder, args.shards, args.ids, name == "in_process")
    return peer_step(args.ids)


def alone(name: str, data, folder: str, token_file: str, args) -> float:
    """Variant `name`'s rows/s, measured as `interleaved` measures each (the same warm-up and
    turns), with no other variant built: its table is released before this returns."""
    with variant(name, folder, token_file, args) as step:
        rate = interleaved({name: step}, data)[name]
    del step  # its model and table: the next variant is built without them
    gc.collect()
    return rate


def print_rates(runs: dict[str, list[float]], shards: int) -> None:
    """Medians, each repeat's figure, and the ratios to the peer of the same repeat (their median)."""
    def line(name: str) -> str:
        return f"{statistics.median(runs[name]):,.0f} rows/s ({', '.join(f'{r:,.0f}' for r in runs[name])})"

    def ratio(name: str, to: str = "peer") -> str:
        each = [ours / theirs for ours, theirs in zip(runs[name], runs[to])]
        return f"{statistics.median(each):.2f}x ({', '.join(f'{r:.2f}' for r in each)})"

    print(f"  peer, single-process PyTorch (nn.Embedding sparse + Adagrad): {line('peer')}")
    print(f"  elastic-step, {shards} local shards, fsync'd ledger: {line('ours')}: {ratio('ours')} the peer")
    print(f"  elastic-step, the {shards} shards' state in-process (fsync'd ledger): {line('in_process')}: "
          f"{ratio('in_process')} the peer; without fsync {ratio('in_process_unsynced')} the peer")
    print(f"  elastic-step without fsync: {line('unsynced')}; with fsync {ratio('ours', 'unsynced')} of that")


def print_scale(report: dict, shards: int) -> None:
    share = report["rows_moved"] / max(1, report["rows_total"])
    print(f"  scale {shards} -> {shards + 1} shards while training: moved {report['moved']} of {report['virtual_shards']} "
          f"virtual shards, {report['rows_moved']:,} of {report['rows_total']:,} rows ({share:.1%}; target <= "
          f"{1 / (shards + 1) + 0.05:.1%}) in {report['seconds']:.2f} s")
    print(f"  a moved virtual shard was refused for at most {report['pause_max_s']:.2f} s (mean {report['pause_mean_s']:.2f} s); "
          f"the longest training step during the move {report['longest_step_during_s']:.2f} s (median step "
          f"{report['median_step_s'] * 1000:.0f} ms, {report['steps_during']} steps during it); the client ended on routing "
          f"epoch {report['epoch_seen']}")


if __name__ == "__main__":
    main()
