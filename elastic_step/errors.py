"""Named errors. Each one carries a message a person can act on: what was wrong, and what to do."""


class ElasticStepError(Exception):
    """Base of every error the CLI turns into a one-line cause and a non-zero exit."""

    exit_code = 2


class ConfigError(ElasticStepError):
    """A command-line value or job setting is invalid (e.g. --workers 4:2)."""


class DataError(ElasticStepError):
    """A dataset, manifest or shard is missing, corrupt or inconsistent."""


class ModelDefinitionError(ElasticStepError):
    """A model definition cannot be imported or lacks a required function."""


class JobFailed(ElasticStepError):
    """Training started but cannot finish (NaN loss, a task that keeps failing, no workers left)."""

    exit_code = 1


class MasterUnreachable(ElasticStepError):
    """The master of a job cannot be reached (it is gone, or the job dir is stale)."""
