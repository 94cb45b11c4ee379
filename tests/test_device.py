"""Where a worker computes: one placement rule for every worker (frameworks/device.py), tested
with the visible-device environment a GPU pod or a GPU machine's local workers would have, and
the PyTorch adapter's device path (gradients staged on the device and copied to the host step
buffer once) checked against the zero-copy CPU path on this machine's CPU. No GPU here: what
only a GPU can run (pinned copies, NCCL) is checked by benchmarks/gpu_check.sh on one."""

import glob
import json
import os
import signal
import types

import numpy as np
import pytest
import torch

from elastic_step.errors import ConfigError
from elastic_step.frameworks.device import (DeviceChoice, Precision, cpu_has_fp16_autocast, parse_choice, parse_precision,
                                            place, placement_here)
from elastic_step.frameworks.model_def import ModelDefinition
from elastic_step.frameworks.torch_trainer import TorchTrainer
from elastic_step.worker.allreduce_step import resident_device


@pytest.mark.parametrize("choice, gpus, slot, expected", [
    (DeviceChoice.AUTO, 0, 0, "cpu"),  # a CPU pod
    (DeviceChoice.AUTO, 1, 5, "cuda:0"),  # a pod given one GPU by its request: always its own
    (DeviceChoice.AUTO, 2, 3, "cuda:1"),  # local workers on a two-GPU machine: one GPU each by slot
    (DeviceChoice.CUDA, 4, 6, "cuda:2"),
    (DeviceChoice.CPU, 8, 1, "cpu"),  # the user's word beats what is visible
])
def test_one_rule_places_every_worker(choice, gpus, slot, expected):
    placement = place(choice, Precision.FP32, gpus, slot)
    assert placement.device == expected
    assert placement.on_gpu == expected.startswith("cuda")
    assert placement.reason  # the worker's log says why


def test_cuda_without_a_visible_gpu_is_refused_in_one_line_naming_what_the_pod_sees(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError) as refused:
        place(DeviceChoice.CUDA, Precision.FP32, 0)
    message = str(refused.value)
    assert "\n" not in message and "--device cuda" in message and "CUDA_VISIBLE_DEVICES=''" in message
    assert "nvidia.com/gpu" in message  # says what to do


def test_this_machine_has_no_gpu_so_auto_is_the_cpu_and_cuda_is_refused():
    assert placement_here(DeviceChoice.AUTO, Precision.FP32).device == "cpu"
    with pytest.raises(ConfigError, match="sees no GPU"):
        placement_here(DeviceChoice.CUDA, Precision.FP32)


def test_precisions_the_device_cannot_run_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^--precision fp16 but this worker computes on the CPU, where this torch has no "
                                          r"float16 autocast: use bf16 or fp32, or a GPU$"):
        place(DeviceChoice.AUTO, Precision.FP16, 0, fp16_on_cpu=False)
    with pytest.raises(ConfigError, match="no bfloat16 support"):
        place(DeviceChoice.AUTO, Precision.BF16, 1, bf16_on_gpu=False)
    assert place(DeviceChoice.AUTO, Precision.BF16, 0).device == "cpu"  # bf16 autocast runs on CPUs
    assert place(DeviceChoice.AUTO, Precision.FP16, 1, fp16_on_cpu=False).device == "cuda:0"  # every GPU has float16
    assert cpu_has_fp16_autocast()  # torch 2.13's CPU autocast has it
    assert placement_here(DeviceChoice.CPU, Precision.FP16).precision == Precision.FP16


def test_a_keras_model_asked_for_another_precision_than_float32_is_refused_not_ignored():
    from elastic_step.frameworks.device import Placement
    from elastic_step.frameworks.registry import _check_keras_placement

    _check_keras_placement(Placement("cpu", Precision.FP32, "test"))
    for precision in (Precision.BF16, Precision.FP16):
        with pytest.raises(ConfigError, match=rf"^--precision {precision.value}: Keras models train in float32 here"):
            _check_keras_placement(Placement("cpu", precision, "test"))


def test_bad_flag_values_name_the_flag_and_the_choices():
    assert parse_choice(" CUDA ") == DeviceChoice.CUDA and parse_precision("bf16") == Precision.BF16
    with pytest.raises(ConfigError, match=r"--device 'gpu' is not a device: use auto, cpu or cuda"):
        parse_choice("gpu")
    with pytest.raises(ConfigError, match=r"--precision 'half' is not a precision"):
        parse_precision("half")


def small_model_def() -> ModelDefinition:
    module = types.ModuleType("small_model")
    module.model = lambda: torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    module.loss = lambda outputs, labels: torch.nn.functional.cross_entropy(outputs, labels)
    module.optimizer = lambda net: torch.optim.Adam(net.parameters(), lr=0.01)
    return ModelDefinition(source="small_model", module=module)


def run_steps(trainer: TorchTrainer, steps: int = 4, buffer=None, staged: bool = False, skip: int = 0) -> list[np.ndarray]:
    """`buffer`: the worker's step buffer (gradients, then a tail the trainer must not touch); a
    numpy one by default. `staged`: the path of a buffer on another device than the trainer's.
    `skip`: the first steps' batches are drawn and not trained (a skipped step)."""
    rng = np.random.default_rng(3)
    if buffer is None:
        buffer = np.zeros(trainer.num_gradient_values + 3, dtype=np.float32)
    grads = buffer[: trainer.num_gradient_values]
    for _ in range(steps):
        features, labels = rng.standard_normal((8, 6)).astype(np.float32), rng.integers(0, 3, 8)
        if skip:
            skip -= 1
            continue
        buffer[:] = 5.0  # stale values must not leak in
        if staged:
            trainer._compute_staged(features, labels, torch.as_tensor(grads))
        else:
            trainer.compute_gradients(features, labels, grads)
        assert (buffer[-3:] == 5.0).all()  # the tail is not touched
        if staged:
            trainer._apply_staged(torch.as_tensor(grads), len(labels))
        else:
            trainer.apply_gradients(grads, len(labels))
    return [p.detach().cpu().numpy().copy() for p in trainer.net.parameters()]


def trainers(model_def, n: int) -> list[TorchTrainer]:
    made = []
    for _ in range(n):
        torch.manual_seed(0)
        made.append(TorchTrainer(model_def, model_def.model()))
    return made


def test_the_staged_device_path_trains_exactly_as_the_zero_copy_cpu_path():
    # The path of a GPU trainer whose step buffer is in host memory (gloo sums it): gradients
    # gathered on the trainer's device, one copy to the buffer, one copy back. Run on the CPU,
    # where the copies stay in host memory: the same bits as the zero-copy path.
    model_def = small_model_def()
    staged, zero_copy = trainers(model_def, 2)
    for ours, theirs in zip(run_steps(staged, staged=True), run_steps(zero_copy)):
        np.testing.assert_array_equal(ours, theirs)
    restored = TorchTrainer(model_def, model_def.model())
    restored.load_state_bytes(staged.state_bytes())  # a checkpoint of the staged trainer loads anywhere
    for ours, theirs in zip(restored.net.parameters(), staged.net.parameters()):
        assert torch.equal(ours, theirs)


def test_a_step_buffer_on_the_trainers_device_is_used_in_place_and_trains_as_a_host_buffer():
    # The path of a GPU trainer whose step NCCL sums on its GPU: the buffer is a tensor on the
    # trainer's device; gradients accumulate in it and the optimizer reads it, with no copy.
    model_def = small_model_def()
    resident, host = trainers(model_def, 2)
    assert resident.gradient_device == torch.device("cpu")
    buffer = torch.zeros(resident.num_gradient_values + 3)
    for ours, theirs in zip(run_steps(resident, buffer=buffer), run_steps(host)):
        np.testing.assert_array_equal(ours, theirs)
    start, end = buffer.data_ptr(), buffer.data_ptr() + 4 * resident.num_gradient_values
    assert all(start <= p.grad.data_ptr() < end for p in resident.params)  # the optimizer read the buffer itself


def test_the_step_buffer_lives_where_the_collective_sums_and_the_trainer_computes():
    cpu, gpu0, gpu1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda:1")
    assert resident_device(cpu, cpu) == cpu  # gloo and a CPU trainer: one buffer, summed as numpy
    assert resident_device(gpu0, torch.device("cuda:0")) == gpu0  # NCCL on the trainer's GPU: in place
    assert resident_device(cpu, gpu0) is None  # gloo and a GPU trainer: host buffer, one copy each way
    assert resident_device(gpu0, cpu) is None  # NCCL and a CPU trainer: the host buffer visits the GPU
    assert resident_device(gpu0, gpu1) is None
    assert resident_device(gpu0, None) is None  # Keras: numpy only


def test_bf16_autocast_trains_float32_parameters_close_to_fp32():
    from elastic_step.frameworks.device import Placement

    model_def = small_model_def()
    torch.manual_seed(0)
    full = TorchTrainer(model_def, model_def.model())
    torch.manual_seed(0)
    half = TorchTrainer(model_def, model_def.model(), Placement("cpu", Precision.BF16, "test"))
    for ours, theirs in zip(run_steps(half), run_steps(full)):
        assert ours.dtype == np.float32
        assert not np.array_equal(ours, theirs)  # bf16 really ran: not the fp32 bits
        np.testing.assert_allclose(ours, theirs, atol=0.02)
    assert half.predict(np.ones((2, 6), dtype=np.float32)).dtype == np.float32


def test_a_local_job_asking_for_cuda_where_this_machine_has_no_gpu_is_refused_before_anything_starts(tmp_path, digits):
    """The local backend's workers see this machine's GPUs: none here, so the master refuses at
    its pre-flight, in one line, exit 2, writing nothing."""
    from conftest import cli

    done = cli("train", "--model-def", "elastic_step.model_zoo.digits_torch", "--data", digits, "--job-dir",
               str(tmp_path / "job"), "--workers", "2", "--epochs", "1", "--device", "cuda", "--no-progress", timeout=120)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("elastic-step train: error: --device cuda but this worker sees no GPU"), line
    assert not (tmp_path / "job").exists()


def test_gpus_asked_of_a_cpu_only_image_or_cuda_without_gpus_are_refused_before_any_pod():
    from elastic_step.errors import ConfigError
    from elastic_step.frameworks.device import check_gpu_request, image_has_cuda
    from elastic_step.images import image_name

    assert image_has_cuda(image_name("torch")) is False and image_has_cuda(image_name("tensorflow", version="9.9")) is False
    assert image_has_cuda("registry.example/ml/digits:1") is None  # a user's image: not judged by its name
    assert image_has_cuda("anything", own=True) is False  # this machine's torch is the CPU build
    check_gpu_request(2, DeviceChoice.CUDA, "registry.example/ml/digits:1")  # not known: the workers' pre-flight judges
    check_gpu_request(0, DeviceChoice.AUTO, image_name("torch"))
    for gpus, choice, image, own, says in [
            (1, DeviceChoice.AUTO, image_name("torch"), False, f"--worker-gpus 1 but the workers' image {image_name('torch')} "
                                                               "is a CPU-only build"),
            (1, DeviceChoice.AUTO, "the-masters-own:1", True, "is a CPU-only build"),
            (0, DeviceChoice.CUDA, "registry.example/ml/digits:1", False, "--device cuda but the worker pods request no GPU"),
            (-1, DeviceChoice.AUTO, "img", False, "--worker-gpus must be 0 or more")]:
        with pytest.raises(ConfigError) as refused:
            check_gpu_request(gpus, choice, image, own=own)
        assert says in str(refused.value) and "\n" not in str(refused.value)


def test_train_on_kubernetes_refuses_gpus_for_the_cpu_only_image_in_one_line(tmp_path):
    """The master pod's `train --backend kubernetes` (the component's and the Argo step's too:
    the same TrainConfig) refuses before creating a pod; --dry-run shows it creates nothing."""
    from conftest import cli
    from elastic_step.images import image_name

    done = cli("train", "--backend", "kubernetes", "--dry-run", "--model-def", "m", "--data", "s3://b/d", "--job-dir",
               str(tmp_path / "job"), "--worker-gpus", "1", "--image", image_name("torch"), timeout=120)
    assert done.returncode == 2 and done.stdout == "", done.stdout
    [line] = done.stderr.strip().splitlines()
    assert "--worker-gpus 1 but the workers' image" in line and "CPU-only build" in line, line


def sgd_model_def() -> ModelDefinition:
    model_def = small_model_def()
    model_def.module.optimizer = lambda net: torch.optim.SGD(net.parameters(), lr=0.1)  # a step moves by lr x gradient
    return model_def


def test_fp16_computes_an_overflowed_pass_again_at_a_smaller_loss_scale_and_skips_no_step():
    from elastic_step.frameworks.device import Placement
    from elastic_step.frameworks.loss_scale import INITIAL

    model_def = sgd_model_def()
    full, skipping = trainers(model_def, 2)
    torch.manual_seed(0)
    half = TorchTrainer(model_def, model_def.model(), Placement("cpu", Precision.FP16, "test"))
    ours = run_steps(half, steps=4)
    # The summed loss of 8 rows at 2**16: a logit's gradient of about 1 per row is past
    # float16's 65504, so the first pass overflows and is computed again at 2**15.
    assert half.loss_scale.overflows >= 1 and half.loss_scale.value < INITIAL
    reference = run_steps(full, steps=4)
    for theirs, mine in zip(reference, ours):
        assert mine.dtype == np.float32 and not np.array_equal(mine, theirs)  # float16 really ran
        np.testing.assert_allclose(mine, theirs, atol=2e-4)
    # What GradScaler would have done (the overflowed first step skipped) is far from it.
    without_first = run_steps(skipping, steps=4, skip=1)
    assert max(float(np.abs(a - b).max()) for a, b in zip(without_first, ours)) > 10 * 2e-4


def test_an_overflowed_fp16_pass_computed_again_leaves_the_model_as_if_it_ran_once():
    """BatchNorm's running statistics and dropout's draws: a pass computed again at a smaller
    scale is the same pass, so the trainer ends exactly where one that started at that scale does."""
    from elastic_step.frameworks.device import Placement

    class Passes(torch.nn.Module):
        """Counts its forward passes in a buffer it replaces each time (as EMA or counter modules do)."""

        def __init__(self):
            super().__init__()
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x):
            self.seen = self.seen + 1
            return x

    model_def = small_model_def()
    model_def.module.model = lambda: torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Dropout(0.5), Passes(),
        torch.nn.Linear(16, 3))
    model_def.module.optimizer = lambda net: torch.optim.SGD(net.parameters(), lr=0.1)

    def fp16_trainer(scale: float | None = None) -> TorchTrainer:
        torch.manual_seed(0)
        trainer = TorchTrainer(model_def, model_def.model(), Placement("cpu", Precision.FP16, "test"))
        if scale is not None:
            trainer.loss_scale.value = scale
        return trainer

    retried = fp16_trainer()
    torch.manual_seed(1)  # dropout's draws
    ours = run_steps(retried, steps=1)
    generator_after = torch.get_rng_state()
    assert retried.loss_scale.overflows >= 1  # the first pass overflowed and was computed again
    at_that_scale = fp16_trainer(retried.loss_scale.value)
    torch.manual_seed(1)
    theirs = run_steps(at_that_scale, steps=1)
    assert at_that_scale.loss_scale.overflows == 0
    np.testing.assert_array_equal(ours[0], theirs[0])  # the same dropout mask, the same gradients
    for mine, other in zip(retried.net.buffers(), at_that_scale.net.buffers()):
        assert torch.equal(mine, other)  # BatchNorm saw the batch once
    assert int(retried.net[1].num_batches_tracked) == 1 and float(retried.net[4].seen) == 1.0
    assert torch.equal(generator_after, torch.get_rng_state())  # dropout drew once


def test_fp16_in_ps_mode_is_refused_before_anything_starts(tmp_path, digits):
    from conftest import cli

    done = cli("train", "--model-def", "elastic_step.model_zoo.digits_torch", "--data", digits, "--job-dir",
               str(tmp_path / "job"), "--mode", "ps", "--precision", "fp16", "--no-progress", timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "elastic-step train: error: --mode ps with --precision fp16 is not offered: the embedding tables' pushes would "
        "carry the loss scale; use --precision bf16 (no loss scale) or fp32"]
    assert not (tmp_path / "job").exists()  # nothing written


def test_a_local_job_trains_in_fp16_with_an_exact_audit_through_a_workers_death(digits, start_job):
    from elastic_step.audit import audit_report

    from conftest import SLOW_MODEL

    job = start_job("--model-def", SLOW_MODEL, "--data", digits, "--workers", "2", "--epochs", "2", "--minibatch-size", "16",
                    "--minibatches-per-task", "2", "--heartbeat-timeout", "4", "--precision", "fp16")
    status = job.wait_for(lambda s: s["world_size"] == 2 and 0.1 < s["rows_done"] / s["rows_total"] < 0.5)
    job.kill_worker(status, rank=1)
    assert job.finish() == 0, job.output()
    report = audit_report(job.audit, digits, 2)
    assert report["exact"], report
    # float16's first passes overflow at 2**16 (summed loss of 16 rows): computed again, and said.
    with open(os.path.join(job.job_dir, "metrics.jsonl")) as steps:
        assert sum(json.loads(line).get("passes_again", 0) for line in steps) >= 1
    logs = "".join(open(path).read() for path in glob.glob(f"{job.job_dir}/logs/*"))
    assert "computing on cpu in fp16" in logs
    assert "float16 gradients overflowed at loss scale 65536: the same rows again at 32768" in logs


def test_the_gpu_checks_script_runs_its_checks_on_the_cpu_so_it_is_ready_when_a_gpu_is():
    # benchmarks/nccl_check.py runs only where a GPU is lent; --device cpu runs the same code
    # with gloo, so that a change to the worker's APIs cannot leave it broken unnoticed.
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "nccl_check.py"), "--device", "cpu"],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=root))
    assert done.returncode == 0, done.stdout + done.stderr
    checks = done.stdout.strip().splitlines()[1:]
    assert len(checks) == 9 and all(line.startswith("  ok   ") for line in checks), done.stdout


@pytest.mark.e2e
def test_the_gpu_check_runs_whole_on_the_cpu_with_a_python_that_has_the_dependencies_but_not_the_project(tmp_path):
    """benchmarks/gpu_check.sh as a GPU machine runs it: its Python has torch and (from .whl/)
    every other dependency, but not the project, which the script installs beside it. Then
    nccl_check.py and bench_gpu.py (the same jobs, kill, audit, peer and status figures) on gloo.
    Once, the check's jobs imported the checkout's elastic_step, which has no model zoo, and
    failed with exit 2; bench_gpu.py once broke unnoticed when status's output changed."""
    import site
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    machine = tmp_path / "python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(machine)], check=True)
    [own_site] = (machine / "lib").glob("python3*/site-packages")
    # This Python's packages, but not its .pth files: the project's editable install stays out.
    (own_site / "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    python = str(machine / "bin" / "python")
    assert subprocess.run([python, "-c", "import elastic_step"], cwd=tmp_path, capture_output=True,
                          env=dict(os.environ, PYTHONPATH="")).returncode != 0
    # Its own session: a check past the deadline is ended whole, its jobs with it.
    check = subprocess.Popen(["bash", os.path.join(root, "benchmarks", "gpu_check.sh")], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=root, start_new_session=True,
                             env=dict(os.environ, PYTHON=python, GPU_CHECK_DEVICE="cpu", PYTHONPATH="",
                                      GPU_CHECK_WHEELS=str(tmp_path / "no-wheels")))  # not a GPU machine's .whl/
    try:
        stdout, stderr = check.communicate(timeout=480)  # within pytest's own limit
    finally:
        if check.poll() is None:
            os.killpg(check.pid, signal.SIGKILL)
            check.wait()
    done = subprocess.CompletedProcess(check.args, check.returncode, stdout, stderr)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert len([line for line in done.stdout.splitlines() if line.startswith("  ok   ")]) == 9, done.stdout
    assert "gloo between them" in done.stdout
    assert "one worker SIGKILLed: exit 0" in done.stdout and "audit exact" in done.stdout, done.stdout
    assert "torchrun+DDP" in done.stdout and "ratio" in done.stdout, done.stdout
