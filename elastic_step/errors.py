"""Named errors. Each one carries a message a person can act on: what was wrong, and what to do,
and exits with its code from elastic_step.exit_codes."""

from elastic_step.exit_codes import ExitCode


class ElasticStepError(Exception):
    """Base of every error the CLI turns into a one-line cause and its exit code (bad input unless
    a subclass says otherwise)."""

    exit_code: int = ExitCode.BAD_INPUT


class ConfigError(ElasticStepError):
    """A command-line value or job setting is invalid (e.g. --workers 4:2)."""


class DataError(ElasticStepError):
    """A dataset, manifest or shard is missing, corrupt or inconsistent."""


class ModelDefinitionError(ElasticStepError):
    """A model definition cannot be imported or lacks a required function."""


class JobFailed(ElasticStepError):
    """Training started but cannot finish (NaN loss, a task that keeps failing, no workers left)."""

    exit_code = ExitCode.FAILED


class JobPreempted(ElasticStepError):
    """The master got SIGTERM and yielded: a checkpoint of its next step saved when there was time,
    the MLflow run marked preempted. Running the same command again resumes it."""

    exit_code = ExitCode.PREEMPTED


class MasterUnreachable(ElasticStepError):
    """The master of a job cannot be reached (it is gone, or the job dir is stale)."""
