"""Steps trained again are not logged again. After a restore from the master's checkpoint (or a
regroup that voided steps, or a resumed run) the group trains step numbers it had trained
before; MLflow keeps every value logged, so the run's per-step metrics would hold two values of
one step. They keep the first; the run's `restores` count says steps were trained again.
(test_restore_e2e.py checks a real job's MLflow history.)"""

from elastic_step.tracking.step_metrics import StepMetrics


class TensorBoard:
    def __init__(self):
        self.scalars = []

    def scalar(self, tag, value, step, time):
        self.scalars.append((tag, step))


def entry(step: int, world_size: int = 2) -> dict:
    """A step as the master's StepLog hands it over: four steps a second."""
    return {"step": step, "time": 1000.0 + step / 4, "samples": 32, "loss": 1.0 / step, "samples_per_s": 128.0,
            "world_size": world_size, "round": 1}


def run(steps, logged_through: int = 0):
    logged, tensorboard = [], TensorBoard()
    metrics = StepMetrics(lambda key, value, step, time: logged.append((key, step, value)), tensorboard, logged_through)
    for step in steps:
        metrics.add(entry(step))
    metrics.flush()
    return logged, tensorboard.scalars


def test_a_step_trained_again_after_a_restore_is_logged_once():
    # Steps 1..12, then a restore to the checkpoint of step 6: steps 7..12 are trained again.
    logged, scalars = run([*range(1, 13), *range(7, 21)])
    loss_steps = [step for key, step, _ in logged if key == "loss"]
    assert loss_steps == sorted(set(loss_steps)) and loss_steps[-1] == 20, loss_steps
    assert len([s for tag, s in scalars if tag == "train/loss"]) == 20  # TensorBoard too: each step once
    # A whole window of first-pass steps is logged as it was, summarised once a second.
    assert ("loss", 5, sum(1.0 / s for s in range(1, 6)) / 5) in logged, logged


def test_a_resumed_run_does_not_log_again_the_steps_its_earlier_attempt_logged():
    logged, _ = run(range(9, 21), logged_through=14)  # the attempt that was preempted logged up to 14
    assert min(step for _, step, _ in logged) > 14, logged


def test_fp16_passes_computed_again_are_logged_as_the_sum_over_the_steps_each_point_summarises():
    logged, tensorboard = [], TensorBoard()
    metrics = StepMetrics(lambda key, value, step, time: logged.append((key, step, value)), tensorboard)
    for step in range(1, 10):
        metrics.add({**entry(step), **({"passes_again": step} if step in (2, 3, 7) else {})})
    metrics.flush()
    # Points at steps 5 and 9 (one a second): 2 + 3 passes, then 7; none where no step overflowed.
    assert [(step, value) for key, step, value in logged if key == "fp16_passes_computed_again"] == [(5, 5), (9, 7)]


def test_every_step_of_a_run_without_restores_is_summarised_as_before():
    logged, _ = run(range(1, 10))
    assert [step for key, step, _ in logged if key == "loss"] == [5, 9]  # a point a second, and the rest at the end
    assert {key for key, _, _ in logged} == {"loss", "world_size", "round", "samples_per_s"}
