"""A fixed global batch (`--global-batch-size G`): every optimizer step applies exactly G rows,
whatever the group's size and wherever tasks end, so a run's steps do not depend on failures;
the exactly-once audit holds step by step. Real worker processes, real signals."""

import collections
import json
import os

import pytest

from elastic_step.audit import audit_report

from conftest import MODEL, SLOW_MODEL

pytestmark = pytest.mark.e2e


def steps(job) -> list[dict]:
    with open(os.path.join(job.job_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def exact(job, digits, epochs) -> int:
    """The rows the job had to apply, once the audit shows each exactly once."""
    report = audit_report(job.audit, digits, epochs)
    assert report["exact"], report
    assert report["rows_applied"] == report["rows_expected"]
    return report["rows_expected"]


def fixed_batches(total: int, g: int) -> list[int]:
    """What every run of the job must apply, step by step: G rows, the last step the rest."""
    return [g] * (total // g) + ([total % g] if total % g else [])


def ranges_per_step(job) -> collections.Counter:
    with open(job.audit) as f:
        return collections.Counter(json.loads(line)["step"] for line in f if '"step"' in line)


def test_every_step_applies_g_rows_over_uneven_ranks_and_tasks_that_end_within_a_step(digits, start_job):
    # 50 rows over 3 ranks: shares of 17, 17 and 16, each computed in minibatches of at most 8;
    # tasks of 24 rows end within steps, so a rank's part of a step spans two tasks.
    job = start_job("--model-def", MODEL, "--data", digits, "--workers", "3", "--epochs", "2", "--global-batch-size", "50",
                    "--minibatch-size", "8", "--minibatches-per-task", "3")
    assert job.finish() == 0, job.output()
    total = exact(job, digits, epochs=2)
    assert [s["samples"] for s in steps(job)] == fixed_batches(total, 50)
    assert max(ranges_per_step(job).values()) > 3  # some rank consumed two tasks in one step
    assert job.result()["test_metrics"]["accuracy"] >= 0.8  # it learns (about 60 steps of 50 rows)


def test_a_global_batch_smaller_than_the_group_leaves_ranks_empty(digits, start_job):
    job = start_job("--model-def", MODEL, "--data", digits, "--workers", "3", "--epochs", "1", "--global-batch-size", "2",
                    "--minibatch-size", "4", "--minibatches-per-task", "4")
    assert job.finish() == 0, job.output()
    total = exact(job, digits, epochs=1)
    assert [s["samples"] for s in steps(job)] == fixed_batches(total, 2)
    assert max(ranges_per_step(job).values()) <= 2  # shares 1, 1, 0: the third rank is empty


def test_killed_and_relaunched_workers_change_nothing_in_the_steps(digits, start_job):
    """The group shrinks from 3 to 2 and grows back; the job applies the same steps of G rows as
    a clean run would, and each row exactly once."""
    job = start_job("--data", digits, "--workers", "2:3", "--epochs", "3", "--global-batch-size", "48",
                    "--model-def", SLOW_MODEL, "--minibatch-size", "16", "--minibatches-per-task", "2",
                    "--heartbeat-timeout", "4")
    status = job.wait_for(lambda s: s["world_size"] == 3 and 0.15 < s["rows_done"] / s["rows_total"] < 0.5)
    job.kill_worker(status, rank=1)
    assert job.finish() == 0, job.output()
    total = exact(job, digits, epochs=3)
    applied = steps(job)
    assert [s["samples"] for s in applied] == fixed_batches(total, 48)
    assert {2, 3} <= {s["world_size"] for s in applied}  # steps were applied by groups of both sizes
    assert any(e["event"] == "died" for e in job.events())
    assert job.result()["test_metrics"]["accuracy"] >= 0.8  # it learns (about 60 steps of 50 rows)


def test_a_global_batch_larger_than_an_epoch_still_fills_every_step(digits, start_job):
    """Each step spans epochs, so a step waits on the master to open the next epoch, which it
    does once it has taken the step that finished the previous one (reported in the background):
    the step must wait for that, not be applied short."""
    job = start_job("--model-def", MODEL, "--data", digits, "--workers", "2", "--epochs", "3", "--global-batch-size", "1000",
                    "--minibatch-size", "50", "--minibatches-per-task", "2")
    assert job.finish() == 0, job.output()
    total = exact(job, digits, epochs=3)
    assert [s["samples"] for s in steps(job)] == fixed_batches(total, 1000)
