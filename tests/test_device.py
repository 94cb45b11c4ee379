"""Where a worker computes: one placement rule for every worker (frameworks/device.py), tested
with the visible-device environment a GPU pod or a GPU machine's local workers would have, and
the PyTorch adapter's device path (gradients staged on the device and copied to the host step
buffer once) checked against the zero-copy CPU path on this machine's CPU. No GPU here: what
only a GPU can run (pinned copies, NCCL) is checked by benchmarks/gpu_check.sh on one."""

import types

import numpy as np
import pytest
import torch

from elastic_step.errors import ConfigError
from elastic_step.frameworks.device import (DeviceChoice, Precision, parse_choice, parse_precision, place,
                                            placement_here)
from elastic_step.frameworks.model_def import ModelDefinition
from elastic_step.frameworks.torch_trainer import TorchTrainer


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


def test_precisions_the_ledger_cannot_keep_exact_or_the_device_cannot_run_are_refused():
    with pytest.raises(ConfigError, match="fp16 is not offered.*bf16"):
        place(DeviceChoice.AUTO, Precision.FP16, 1)
    with pytest.raises(ConfigError, match="no bfloat16 support"):
        place(DeviceChoice.AUTO, Precision.BF16, 1, bf16_on_gpu=False)
    assert place(DeviceChoice.AUTO, Precision.BF16, 0).device == "cpu"  # bf16 autocast runs on CPUs


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


def run_steps(trainer: TorchTrainer, steps: int = 4) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    buffer = np.zeros(trainer.num_gradient_values + 3, dtype=np.float32)  # the worker's buffer has a tail
    grads = buffer[: trainer.num_gradient_values]
    for _ in range(steps):
        features, labels = rng.standard_normal((8, 6)).astype(np.float32), rng.integers(0, 3, 8)
        buffer[:] = 5.0  # stale values must not leak in
        trainer.compute_gradients(features, labels, grads)
        assert (buffer[-3:] == 5.0).all()  # the tail is not touched
        trainer.apply_gradients(grads, len(labels))
    return [p.detach().cpu().numpy().copy() for p in trainer.net.parameters()]


def test_the_staged_device_path_trains_exactly_as_the_zero_copy_cpu_path():
    # The path a GPU worker takes (gradients gathered on the device, one copy to the host step
    # buffer, one copy back), run on the CPU: the same bits as the zero-copy path.
    model_def = small_model_def()
    torch.manual_seed(0)
    zero_copy = TorchTrainer(model_def, model_def.model())
    torch.manual_seed(0)
    staged = TorchTrainer(model_def, model_def.model())
    staged._staged = True  # as on a GPU; the placement's device is still the CPU here
    for ours, theirs in zip(run_steps(staged), run_steps(zero_copy)):
        np.testing.assert_array_equal(ours, theirs)
    restored = TorchTrainer(model_def, model_def.model())
    restored.load_state_bytes(staged.state_bytes())  # a checkpoint of the staged trainer loads anywhere
    for ours, theirs in zip(restored.net.parameters(), staged.net.parameters()):
        assert torch.equal(ours, theirs)


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


def test_fp16_is_refused_before_anything_starts(tmp_path, digits):
    from conftest import cli

    done = cli("train", "--model-def", "elastic_step.model_zoo.digits_torch", "--data", digits, "--job-dir",
               str(tmp_path / "job"), "--precision", "fp16", "--no-progress", timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "elastic-step train: error: --precision fp16 is not offered: a loss-scaled step that overflows is skipped, "
        "losing rows the ledger counts as applied; use bf16 (float32's range, no loss scale) or fp32"]
    assert not (tmp_path / "job").exists()  # nothing written
