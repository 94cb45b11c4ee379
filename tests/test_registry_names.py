"""A registered model's name inside MLflow's search filters. MLflow's filter parser has no escapes:
`name = 'it's'` is no filter at all, and the export once read that failure as "this run has no
version yet" and registered the same weights again on every retry."""

import pytest
from mlflow.tracking import MlflowClient

from elastic_step.errors import ConfigError
from elastic_step.release.export import SOURCE_RUN_TAG, _version_of_run
from elastic_step.release.registry import name_filter


@pytest.fixture
def client(tmp_path):
    return MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")


@pytest.mark.parametrize("name", ["digits", "it's digits", 'the "best" digits'])
def test_a_retried_export_finds_the_version_its_run_registered_whatever_quote_the_name_holds(client, name, tmp_path):
    run_id = "0123456789abcdef0123456789abcdef"
    assert _version_of_run(client, name, run_id) is None  # nothing registered under the name yet
    client.create_registered_model(name)
    assert _version_of_run(client, name, run_id) is None  # the model, but no version of this run
    made = client.create_model_version(name, str(tmp_path / "weights"), tags={SOURCE_RUN_TAG: run_id})
    found = _version_of_run(client, name, run_id)
    assert found is not None and found.version == made.version
    assert [v.version for v in client.search_model_versions(name_filter(name))] == [made.version]


def test_a_name_holding_both_quotes_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"""^registered model name 'it\\'s "x"' holds both kinds of quote"""):
        name_filter("""it's "x\"""")


def test_a_search_that_fails_for_another_reason_is_not_taken_for_no_version(client, monkeypatch):
    from mlflow.exceptions import MlflowException

    client.create_registered_model("digits")

    def unavailable(*args, **kwargs):
        raise MlflowException("the registry is read-only for now", error_code="TEMPORARILY_UNAVAILABLE")

    monkeypatch.setattr(client, "search_model_versions", unavailable)
    with pytest.raises(MlflowException, match="read-only"):
        _version_of_run(client, "digits", "0123456789abcdef0123456789abcdef")
