"""The GPU paths one GPU can check, in one process (benchmarks/gpu_check.sh runs it first; a
2-worker job on NCCL needs two GPUs, since NCCL refuses two ranks on one):

1. a worker's step on NCCL: the step buffer in the GPU's memory, the trainer's gradients
   accumulated in it (no copy), NCCL summing it in place, the optimizer reading the sum there;
2. the regroup's abort: a group aborted as a survivor aborts it, then a new group on a new prefix of
   the same store in the same process, which sums again (one GPU: the group aborted is idle; an
   abort that ends a hung peer's operation needs two);
3. a checkpoint's snapshot taken from device tensors (copied into pinned host memory), serialised
   later and loaded on the CPU; and the state loaded by a trainer on the GPU, as a joiner or a
   resume loads it, which then takes Adam steps there;
4. fp16 on the GPU: autocast to float16, an overflowed pass computed again at a smaller loss
   scale, parameters kept float32.

Prints one line per check and exits 1 at the first that fails. No GPU: exits 2 at once. With
--device cpu it runs the same checks on the CPU with gloo, which is how the script itself is
checked on a machine without a GPU (tests/test_device.py); they then say nothing about GPUs."""

from __future__ import annotations

import argparse
import io
import sys
import time

import numpy as np
import torch
import torch.distributed as dist


def check(what: str, ok: bool, detail: str = "") -> None:
    print(f"  {'ok  ' if ok else 'FAIL'} {what}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        sys.exit(1)


def digits_like_trainer(device: str, precision):
    from elastic_step.frameworks.device import Placement
    from elastic_step.frameworks.model_def import load_model_definition
    from elastic_step.frameworks.torch_trainer import TorchTrainer

    model_def = load_model_definition("elastic_step.model_zoo.digits_torch")
    torch.manual_seed(0)
    return TorchTrainer(model_def, model_def.model(), Placement(device, precision, "nccl check"))


def batch(rows: int = 64):
    rng = np.random.default_rng(0)
    return rng.standard_normal((rows, 64)).astype(np.float32), rng.integers(0, 10, rows)


def step_on_nccl(collective, trainer) -> None:
    from elastic_step.worker.allreduce_step import resident_device
    from elastic_step.worker.rows import Piece
    from elastic_step.worker.step_buffer import StepBuffer

    device = resident_device(collective.device, trainer.gradient_device)
    check("the step buffer lives on the trainer's device", device is not None and device == trainer.device, str(device))
    buffer = StepBuffer(trainer.num_gradient_values, 1, 0, device)
    features, labels = batch()
    buffer.clear_meta()
    buffer.add_loss(trainer.compute_gradients(features, labels, buffer.gradients))
    buffer.add_piece(0, Piece(7, 0, len(labels), None, None))
    start = buffer.gradients.data_ptr()
    end = start + 4 * trainer.num_gradient_values
    check("gradients accumulate in the buffer itself", all(start <= p.grad.data_ptr() < end for p in trainer.params))
    before = buffer.gradients.clone()
    buffer.sum_over(collective)
    synchronize(collective.device)
    check(f"{collective.backend}'s allreduce ran on the buffer in place (one rank: the sum is the buffer itself)",
          torch.equal(before, buffer.gradients) and buffer.gradients.data_ptr() == start)
    check("the counts and ranges came back through the host mirror",
          buffer.samples == len(labels) and [(r.task_id, r.count) for r in buffer.ranges_of(0)] == [(7, len(labels))])
    weights = [p.detach().clone() for p in trainer.params]
    trainer.apply_gradients(buffer.gradients, len(labels))
    moved = all(not torch.equal(w, p) for w, p in zip(weights, trainer.params))
    check("the optimizer applied the sum from the buffer", moved)


def abort_and_regroup(collective) -> None:
    started = time.monotonic()
    collective._abort()  # as await_or_abort calls it
    collective.leave()
    collective.join("nccl-check-2/", rank=0, world_size=1)
    tensor = torch.ones(1024, device=collective.device)
    collective.allreduce_sum(tensor)
    synchronize(collective.device)
    unlike_a_worker = "" if collective.backend == "nccl" else " (a worker never aborts a gloo group)"
    check(f"abort, then a new group in the same process sums again{unlike_a_worker}", bool((tensor == 1).all()),
          f"{time.monotonic() - started:.3f} s")


def snapshot_from_the_gpu(trainer) -> None:
    from elastic_step.frameworks.device import Precision

    snapshot = trainer.state_snapshot()
    expected = trainer.state_bytes()
    features, labels = batch()
    grads = np.zeros(trainer.num_gradient_values, dtype=np.float32)
    trainer.compute_gradients(features, labels, grads)  # training goes on after the snapshot
    trainer.apply_gradients(grads, len(labels))
    on_cpu = digits_like_trainer("cpu", Precision.FP32)
    on_cpu.load_state_bytes(snapshot.to_bytes())
    reference = torch.load(io.BytesIO(expected), weights_only=True)["model"]
    same = all(torch.equal(p.detach(), reference[name]) for name, p in on_cpu.net.state_dict().items())
    check(f"a checkpoint's snapshot from {trainer.device} loads on the CPU as of its step", same)


def joiner_on_the_device(trainer) -> None:
    from elastic_step.frameworks.device import Precision

    joiner = digits_like_trainer(str(trainer.device), Precision.FP32)
    joiner.load_state_bytes(trainer.state_bytes())
    same = all(torch.equal(a, b) for a, b in zip(joiner.params, trainer.params))
    features, labels = batch()
    for t in (trainer, joiner):
        grads = torch.zeros(t.num_gradient_values, device=t.device)
        t.compute_gradients(features, labels, grads)
        t.apply_gradients(grads, len(labels))
    after = all(torch.equal(a, b) for a, b in zip(joiner.params, trainer.params))
    check(f"a state loaded on {trainer.device} (a joiner's, a resume's) trains on in step with its source", same and after)


def fp16(device: str) -> None:
    from elastic_step.frameworks.device import Precision

    trainer = digits_like_trainer(device, Precision.FP16)
    grads = torch.zeros(trainer.num_gradient_values, device=device)
    for _ in range(3):
        features, labels = batch()
        trainer.compute_gradients(features, labels, grads)
        trainer.apply_gradients(grads, len(labels))
    scale = trainer.loss_scale
    ok = scale.overflows >= 1 and all(p.dtype == torch.float32 for p in trainer.params) and bool(torch.isfinite(grads).all())
    check("fp16: overflowed passes computed again, float32 parameters", ok,
          f"{scale.overflows} pass(es) again, loss scale now {scale.value:g}")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("nccl check: torch sees no GPU", file=sys.stderr)
        sys.exit(2)
    from elastic_step.frameworks.device import Precision
    from elastic_step.worker.collective import Collective

    device, backend = ("cuda:0", "nccl") if args.device == "cuda" else ("cpu", "gloo")
    seen = (f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, {torch.cuda.get_device_name(0)}"
            if args.device == "cuda" else "the CPU with gloo (checks the script, says nothing about GPUs)")
    print(f"nccl check: torch {torch.__version__}, {seen}", flush=True)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    collective = Collective("127.0.0.1", store.port, timeout_s=60, link_key=b"check", backend=backend,
                            gpu=device if backend == "nccl" else None)
    collective.join("nccl-check-1/", rank=0, world_size=1)
    trainer = digits_like_trainer(device, Precision.FP32)
    step_on_nccl(collective, trainer)
    abort_and_regroup(collective)
    collective.leave()
    snapshot_from_the_gpu(trainer)
    joiner_on_the_device(trainer)
    fp16(device)


if __name__ == "__main__":
    main()
