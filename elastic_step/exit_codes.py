"""The exit codes of every `elastic-step` command and pipeline step: one table, so that a retry
policy (Argo's `retryStrategy.expression`, a shell loop, a scheduler) can tell what is worth
another attempt. README.md ("Exit codes") shows the same table; tests/test_exit_codes.py keeps the
Argo expression, the errors and this table in step."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    SUCCESS = 0
    """Done: the step's outputs are written. Also `train` after the operator's own `stop` (a
    final checkpoint is saved; `train` again continues it): a stop is an end the operator asked
    for, so no retry policy may undo it."""

    FAILED = 1
    """The work started and could not finish (no workers left, a loss that is not finite, a task
    whose rows keep failing, MLflow refusing a record for good). Worth a bounded number of
    retries: a retried `train` resumes its run from the newest checkpoint."""

    BAD_INPUT = 2
    """Bad input: a flag, a dataset, a model definition, credentials, a run that cannot be
    resumed with these inputs. The one-line message says what to change; never retry, another
    attempt fails the same way."""

    PREEMPTED = 75
    """Preempted: the process got SIGTERM (an eviction, a node drain, a spot shutdown, a
    higher-priority workload), checkpointed its next step within the grace period when it could,
    and yielded. Always retry: the same command resumes where the checkpoint left off. 75 is
    sysexits.h's EX_TEMPFAIL, "a temporary failure; the user is invited to retry"."""


def argo_retry_expression(failure_retries: int) -> str:
    """The train step's `retryStrategy.expression` (Argo evaluates it with expr after each failed
    attempt, within `limit`). The variables are the workflow controller's
    (buildRetryStrategyLocalScope): `lastRetry.exitCode` is a string, "-1" when the pod left none
    (deleted, its node gone); `retries` is the number of retries made so far, as a string.
    A preemption is always retried (up to the limit); any other end except bad input, such as a
    failure or a pod killed before it could say anything (137, 143, -1), while fewer than
    `failure_retries` retries were made; bad input never."""
    return (f"lastRetry.exitCode == '{ExitCode.PREEMPTED.value}' or "
            f"(lastRetry.exitCode != '{ExitCode.BAD_INPUT.value}' and asInt(retries) < {int(failure_retries)})")
