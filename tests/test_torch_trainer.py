"""The PyTorch adapter computes summed per-sample gradients into the worker's flat step buffer and
applies the averaged sum: the result must equal what plain PyTorch does on the same batch, both
on the zero-copy path (float32 parameters: .grad are views of the buffer) and on the copy path
(any other dtype)."""

import io
import types

import numpy as np
import pytest
import torch

from elastic_step.frameworks.model_def import ModelDefinition
from elastic_step.frameworks.torch_trainer import TorchTrainer


def small_model_def(dtype: torch.dtype) -> ModelDefinition:
    module = types.ModuleType("small_model")
    module.model = lambda: torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)).to(dtype)
    module.loss = lambda outputs, labels: torch.nn.functional.cross_entropy(outputs, labels)
    module.optimizer = lambda net: torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    return ModelDefinition(source="small_model", module=module)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_three_steps_match_plain_pytorch(dtype):
    model_def = small_model_def(dtype)
    torch.manual_seed(0)
    trainer = TorchTrainer(model_def, model_def.model())
    torch.manual_seed(0)
    reference = model_def.model()
    reference_optimizer = model_def.optimizer(reference)
    rng = np.random.default_rng(1)
    buffer = np.zeros(trainer.num_gradient_values + 4, dtype=np.float32)  # the worker's buffer has a tail
    grads = buffer[: trainer.num_gradient_values]
    for _ in range(3):
        features = rng.standard_normal((8, 6)).astype(np.float32 if dtype == torch.float32 else np.float64)
        labels = rng.integers(0, 3, 8)
        buffer[:] = 7.0  # stale values from the last step must not leak in
        loss_sum = trainer.compute_gradients(features, labels, grads)

        reference_optimizer.zero_grad()
        mean = model_def.loss(reference(torch.from_numpy(features)), torch.from_numpy(labels))
        (mean * len(labels)).backward()
        expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()]).float().numpy()
        np.testing.assert_allclose(grads, expected, rtol=1e-5, atol=1e-6)
        assert loss_sum == pytest.approx(float(mean.detach()) * len(labels), rel=1e-5)
        assert (buffer[-4:] == 7.0).all()  # the tail (sample count, loss, flags) is not touched

        trainer.apply_gradients(grads, total_samples=len(labels))
        for p in reference.parameters():
            p.grad /= len(labels)
        reference_optimizer.step()
        assert (buffer[-4:] == 7.0).all()
        for ours, theirs in zip(trainer.net.parameters(), reference.parameters()):
            assert ours.dtype == dtype
            np.testing.assert_allclose(ours.detach().numpy(), theirs.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_linear_lr_scaling_makes_a_short_step_weigh_as_a_share_of_the_full_groups_batch():
    # With SGD, the linear rule is exact: a step of B rows at rate x B/B_full moves the weights
    # as the sum of its gradients over B_full would at the model definition's rate.
    from elastic_step.protocol import LrScaling

    model_def = small_model_def(torch.float32)
    features = np.random.default_rng(2).standard_normal((8, 6)).astype(np.float32)
    labels = np.arange(8) % 3
    moved = {}
    for name, factor, divide_by in (("scaled", LrScaling.LINEAR.factor(8, 24), 8), ("full", 1.0, 24)):
        torch.manual_seed(0)
        trainer = TorchTrainer(model_def, model_def.model())
        grads = np.zeros(trainer.num_gradient_values, dtype=np.float32)
        trainer.compute_gradients(features, labels, grads)
        trainer.scale_learning_rate(factor)
        trainer.apply_gradients(grads, divide_by)
        moved[name] = [p.detach().numpy().copy() for p in trainer.net.parameters()]
    for a, b in zip(moved["scaled"], moved["full"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert LrScaling.SQRT.factor(8, 32) == 0.5 and LrScaling.NONE.factor(8, 32) == 1.0


def test_lr_scaling_starts_from_the_model_definitions_rate_even_after_a_scaled_state_is_loaded():
    model_def = small_model_def(torch.float32)
    scaled = TorchTrainer(model_def, model_def.model())
    scaled.scale_learning_rate(0.5)
    scaled.scale_learning_rate(0.5)  # never compounding
    assert [g["lr"] for g in scaled.optimizer.param_groups] == [0.05]
    other = TorchTrainer(model_def, model_def.model())
    other.load_state_bytes(scaled.state_bytes())  # a broadcast from a rank of a smaller round
    other.scale_learning_rate(1.0)
    assert [g["lr"] for g in other.optimizer.param_groups] == [0.1]


def test_a_checkpoints_snapshot_holds_the_state_of_its_step_while_training_goes_on():
    # A checkpoint's state is copied at its step and serialised later on the sender's thread:
    # the steps trained meanwhile must not reach it, and it must load as state_bytes() does.
    model_def = small_model_def(torch.float32)
    model_def.module.optimizer = lambda net: torch.optim.Adam(net.parameters(), lr=0.01)  # state beside each parameter
    torch.manual_seed(0)
    trainer = TorchTrainer(model_def, model_def.model())
    rng = np.random.default_rng(2)
    grads = np.zeros(trainer.num_gradient_values, dtype=np.float32)

    def step():
        features, labels = rng.standard_normal((8, 6)).astype(np.float32), rng.integers(0, 3, 8)
        trainer.compute_gradients(features, labels, grads)
        trainer.apply_gradients(grads, 8)

    step()
    at_the_step = trainer.state_bytes()
    snapshot = trainer.state_snapshot()
    for _ in range(3):
        step()
    saved = torch.load(io.BytesIO(snapshot.to_bytes()), weights_only=True)
    expected = torch.load(io.BytesIO(at_the_step), weights_only=True)
    assert saved["model"].keys() == expected["model"].keys()
    for key, value in expected["model"].items():
        assert torch.equal(saved["model"][key], value)
        assert saved["model"][key].untyped_storage().nbytes() == value.numel() * value.element_size()  # its own storage
    assert saved["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
    for index, state in expected["optimizer"]["state"].items():
        assert state.keys() == saved["optimizer"]["state"][index].keys()
        for name, value in state.items():
            assert torch.equal(saved["optimizer"]["state"][index][name], value), name
    assert torch.equal(saved["rng"], expected["rng"])
    later = TorchTrainer(model_def, model_def.model())
    later.load_state_bytes(snapshot.to_bytes())
    restored = TorchTrainer(model_def, model_def.model())
    restored.load_state_bytes(at_the_step)
    for ours, theirs in zip(later.net.parameters(), restored.net.parameters()):
        assert torch.equal(ours, theirs)


def test_a_checkpoint_that_cannot_be_serialised_on_the_senders_thread_is_logged_not_lost_in_silence(caplog):
    from elastic_step.frameworks.api import StateSnapshot
    from elastic_step.worker.checkpoints import Checkpoints

    class Broken(StateSnapshot):
        def to_bytes(self) -> bytes:
            raise MemoryError("no room for the checkpoint")

    class Master:
        def call(self, *args, **kwargs):
            raise AssertionError("nothing to send")

    import types

    checkpoints = Checkpoints(client=Master(), worker_id="w0.1", every=1,
                              reporter=types.SimpleNamespace(epoch=0, checkpoint_requested=False))
    with caplog.at_level("ERROR", logger="elastic_step.worker"):
        assert checkpoints.due(7)
        checkpoints.send(round_id=1, step=7, snapshot=lambda: Broken(b""))
        checkpoints.drain()
    [record] = [r for r in caplog.records if "checkpoint of step 7 not sent" in r.getMessage()]
    assert "no room for the checkpoint" in record.exc_text
    assert checkpoints.due(8) and checkpoints.due(9)  # its place was given back with the other's


def test_checkpoints_slower_to_send_than_to_take_hold_two_copies_at_most_and_one_due_meanwhile_comes_later(caplog):
    """A snapshot is a copy of the whole state: a slow master must not pile them up in memory, nor
    make rank 0 wait (its peers would wait for it in the next collective)."""
    import threading
    import types

    from elastic_step.frameworks.api import StateSnapshot
    from elastic_step.worker.checkpoints import MAX_HELD, Checkpoints

    class Snapshot(StateSnapshot):
        def __init__(self, step):
            self.step = step

        def to_bytes(self) -> bytes:
            return str(self.step).encode()

    class SlowMaster:
        def __init__(self):
            self.go, self.sent = threading.Event(), []

        def call(self, method, route, content, params):
            assert self.go.wait(30)
            self.sent.append((params["step"], content))

    master, taken = SlowMaster(), []
    reporter = types.SimpleNamespace(epoch=0, checkpoint_requested=False)
    checkpoints = Checkpoints(client=master, worker_id="w0.1", every=2, reporter=reporter)

    def step(number: int) -> bool:
        if not checkpoints.due(number):
            return False
        checkpoints.send(round_id=1, step=number, snapshot=lambda: taken.append(number) or Snapshot(number))
        return True

    with caplog.at_level("WARNING", logger="elastic_step.worker"):
        assert [step(n) for n in range(1, 6)] == [False, True, False, True, False] and MAX_HELD == 2
        assert not step(6)  # due, but both places are held: put off, no third copy taken
        assert taken == [2, 4]
        master.go.set()
        checkpoints.drain()
        assert step(7)  # the first step with room takes the checkpoint put off at step 6
    checkpoints.drain()
    assert taken == [2, 4, 7] and master.sent == [(2, b"2"), (4, b"4"), (7, b"7")]
    [line] = [r.getMessage() for r in caplog.records if "put off" in r.getMessage()]
    assert line.startswith("checkpoint of step 6 put off") and "raise --checkpoint-steps" in line
    assert step(8) and not step(9)  # and on as before
    checkpoints.drain()
    assert checkpoints.put_off == 1


def test_the_evaluation_gate_names_a_models_missing_run_in_one_line(tmp_path):
    # A runs:/ URI names its run without asking MLflow: a run deleted, collected or never made
    # is found missing when its files are listed, and says so as the weights file's absence does.
    from elastic_step.errors import ElasticStepError
    from elastic_step.frameworks.weights import TrainedRun, WeightsError

    uri = "runs:/0123456789abcdef0123456789abcdef/model"
    with pytest.raises(WeightsError) as missing:
        TrainedRun.of(uri, tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    assert isinstance(missing.value, ElasticStepError)  # the CLI's one line and exit 2, no traceback
    assert str(missing.value).startswith(f"run 0123456789abcdef0123456789abcdef of model {uri!r} has no weights file "
                                         "elastic_step_model/model.bin (")
