"""The worker's per-phase step times: what its log says at the end of each round."""

import time

from elastic_step.worker.timing import Phase, StepTimes


def test_each_phase_gets_the_time_since_the_previous_mark_and_the_summary_is_per_step():
    times = StepTimes()
    for _ in range(4):
        times.start()
        time.sleep(0.002)
        times.mark(Phase.DATA)
        time.sleep(0.02)
        times.mark(Phase.ALLREDUCE)
        times.steps += 1
    assert times.seconds[Phase.ALLREDUCE] > 5 * times.seconds[Phase.DATA] > 0
    assert times.seconds[Phase.GRADIENTS] == 0.0
    summary = times.summary()
    assert summary.startswith("4 steps, ") and "allreduce 2" in summary and "gradients 0.00" in summary
    assert StepTimes().summary() == "no steps"
