"""The peer elastic-step is measured against: plain torchrun + DistributedDataParallel on the
same model definition and data. Run under torchrun; rank 0 appends one JSON line per step
({"step", "time", "samples"}) to --step-log (written every 0.2 s). Each epoch's rows are permuted
once, before its loop, which holds nothing but the step. With --checkpoint-dir it saves every
--checkpoint-every steps and resumes from the newest checkpoint after a torchrun restart."""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic_step.data.manifest import load_manifest
from elastic_step.data.reader import ShardReader
from elastic_step.frameworks.model_def import batch_arrays, load_model_definition


def epoch_batches(features, labels, epoch: int, rank: int, world: int, minibatch: int, steps: int):
    """This rank's minibatches of one epoch, as tensors indexed by step: one permutation of the
    rows per epoch (the same on every rank), rank r taking minibatch r of each step's `world`."""
    order = np.random.default_rng(epoch).permutation(len(labels))[:steps * world * minibatch]
    mine = order.reshape(steps, world, minibatch)[:, rank, :]
    return torch.from_numpy(features[mine]), torch.from_numpy(labels[mine])


class StepLog:
    """Rank 0's {"step", "time", "samples"} lines, written in batches (every 0.2 s), so the log
    costs the loop an append per step rather than a write and a flush."""

    def __init__(self, path: str, samples: int):
        self.file = open(path, "a")
        self.samples = samples
        self.pending: list[tuple[int, float]] = []
        self.written = time.monotonic()

    def record(self, step: int) -> None:
        self.pending.append((step, time.time()))
        if time.monotonic() - self.written > 0.2:
            self.flush()

    def flush(self) -> None:
        self.file.write("".join(json.dumps({"step": s, "time": t, "samples": self.samples}) + "\n" for s, t in self.pending))
        self.file.flush()
        self.pending, self.written = [], time.monotonic()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-def", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--minibatch-size", type=int, default=32)
    parser.add_argument("--step-log", required=True)
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--pid-dir")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: each rank on the GPU of its LOCAL_RANK (modulo the GPUs there are), the epoch's batches "
                             "on the GPU")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo",
                        help="nccl needs a GPU per rank: NCCL refuses two ranks on one GPU")
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local % torch.cuda.device_count()) if args.device == "cuda" else torch.device("cpu")
    if args.pid_dir:
        with open(os.path.join(args.pid_dir, f"rank{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
    model_def = load_model_definition(args.model_def)
    torch.manual_seed(0)
    net = model_def.model().to(device)
    ddp = DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = model_def.optimizer(net)
    manifest = load_manifest(args.data)
    features, labels = batch_arrays(model_def, ShardReader(manifest).read_split("train"), manifest.features, manifest.label)

    step = 0
    checkpoint = os.path.join(args.checkpoint_dir, "latest.pt") if args.checkpoint_dir else None
    if checkpoint and os.path.exists(checkpoint):
        state = torch.load(checkpoint, weights_only=True, map_location=device)
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    steps_per_epoch = len(labels) // (args.minibatch_size * world)
    log = StepLog(args.step_log, args.minibatch_size * world) if rank == 0 else None
    while step < steps_per_epoch * args.epochs:
        epoch, first = divmod(step, steps_per_epoch)
        xs, ys = epoch_batches(features, labels, epoch, rank, world, args.minibatch_size, steps_per_epoch)
        xs, ys = xs.to(device), ys.to(device)  # once per epoch: a no-op on the CPU
        for index in range(first, steps_per_epoch):  # nothing but the step (and the peer's own log and checkpoint)
            optimizer.zero_grad()
            loss = model_def.loss(ddp(xs[index]), ys[index])
            loss.backward()
            optimizer.step()
            step += 1
            if log:
                log.record(step)
            if checkpoint and rank == 0 and step % args.checkpoint_every == 0:
                torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, checkpoint + ".tmp")
                os.replace(checkpoint + ".tmp", checkpoint)
    if log:
        log.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
