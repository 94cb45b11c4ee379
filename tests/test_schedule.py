"""Scheduled retraining on KFP: cron conversion (five fields → KFP's six), time zones, and the
exact recurring-run call made through kfp.Client (a fake at that boundary: no KFP server runs here)."""

import importlib.machinery
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest

from elastic_step import schedule
from elastic_step.cli import main
from elastic_step.errors import ConfigError

JANUARY = datetime(2026, 1, 15, 12, 0, tzinfo=timezone.utc)


@pytest.mark.parametrize("given,six,fields", [
    ("0 3 * * *", "0 0 3 * * *", 5),
    ("  0   3 * * *  ", "0 0 3 * * *", 5),
    ("*/15 * * * *", "0 */15 * * * *", 5),
    ("0 9 * * MON-FRI", "0 0 9 * * MON-FRI", 5),
    ("0 0 1 jan,jul *", "0 0 0 1 jan,jul *", 5),
    ("5,35 8-18/2 ? * 1-5", "0 5,35 8-18/2 ? * 1-5", 5),
    ("30 0 3 * * *", "30 0 3 * * *", 6),
    ("0 0 9 ? * 2-6", "0 0 9 ? * 2-6", 6),
    ("*/10 * * * * *", "*/10 * * * * *", 6),
])
def test_kfp_cron_conversion_table(given, six, fields):
    converted = schedule.kfp_cron(given)
    assert converted.expression == six and converted.given_fields == fields
    assert ("five fields" if fields == 5 else "six fields") in converted.note


@pytest.mark.parametrize("given,message", [
    ("", "empty"),
    ("0 3 * *", "has 4 fields"),
    ("0 3 * * * * *", "has 7 fields"),
    ("60 3 * * *", "minute 60 is out of range 0-59"),
    ("0 24 * * *", "hour 24 is out of range 0-23"),
    ("0 3 0 * *", "day-of-month 0 is out of range 1-31"),
    ("0 3 * 13 *", "month 13 is out of range 1-12"),
    ("0 3 * * 7", "day-of-week 7 is out of range 0-6"),
    ("0 3 * * FUNDAY", "not a number"),
    ("*/0 * * * *", "step"),
    ("5-1 * * * *", "runs backwards"),
    ("? 3 * * *", "only allowed in day-of-month and day-of-week"),
    ("0 3,, * * *", "empty item"),
    ("@daily", "write the schedule as fields"),
    ("61 0 3 * * *", "second 61 is out of range"),
])
def test_invalid_cron_is_a_clear_error(given, message):
    with pytest.raises(ConfigError, match=message):
        schedule.kfp_cron(given)


def test_argo_cron_takes_five_fields_and_says_what_to_do_with_six():
    assert schedule.argo_cron("0  3 * * *") == "0 3 * * *"
    with pytest.raises(ConfigError, match=r"drop the seconds, e.g. '0 3 \* \* \*'"):
        schedule.argo_cron("0 0 3 * * *")


@pytest.mark.parametrize("tz,six,expected,warns", [
    ("UTC", "0 0 3 * * *", "0 0 3 * * *", False),
    ("Europe/Berlin", "0 0 3 * * *", "0 0 2 * * *", True),      # UTC+1 in January, DST in summer
    ("Asia/Tokyo", "0 30 3 * * *", "0 30 18 * * *", False),    # UTC+9: across midnight, every day anyway
    ("America/New_York", "0 0 22,23 * * *", "0 0 3,4 * * *", True),
    ("Asia/Tokyo", "0 0 */6 * * *", "0 0 3,9,15,21 * * *", False),
    ("Europe/Berlin", "0 0 * * * *", "0 0 * * * *", True),
])
def test_timezone_is_shifted_to_utc(tz, six, expected, warns):
    shifted, warning = schedule.shift_to_utc(six, tz, now=JANUARY)
    assert shifted == expected
    assert (warning is not None) == warns


@pytest.mark.parametrize("tz,six,message", [
    ("Asia/Tokyo", "0 0 3 * * MON", "across midnight"),
    ("Asia/Kolkata", "0 0 3 * * *", "not whole hours"),
    ("Mars/Olympus", "0 0 3 * * *", "not an IANA time zone"),
])
def test_timezone_that_cannot_be_shifted_is_a_clear_error(tz, six, message):
    with pytest.raises(ConfigError, match=message):
        schedule.shift_to_utc(six, tz, now=JANUARY)


# ---- the recurring run --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    """A small compiled pipeline standing in for pipelines/compiled/retraining_pipeline.yaml.
    (This module has no `from __future__ import annotations`: kfp reads real annotation types.)"""
    from kfp import compiler, dsl

    @dsl.component(base_image="python:3.11")
    def hello(epochs: int) -> int:
        return epochs

    @dsl.pipeline(name="retraining-pipeline")
    def retraining_pipeline(epochs: int = 1):
        hello(epochs=epochs)

    path = tmp_path_factory.mktemp("kfp") / "retraining_pipeline.yaml"
    compiler.Compiler().compile(retraining_pipeline, str(path))
    return path


class FakeClient:
    """Stands in for kfp.Client: records what it is asked; `instances` keeps every client made."""

    instances: list["FakeClient"] = []
    fail_with: Exception | None = None

    def __init__(self, host=None, **kwargs):
        self.host, self.kwargs, self.calls = host, kwargs, []
        FakeClient.instances.append(self)

    def create_experiment(self, name, description=None, namespace=None):
        if FakeClient.fail_with:
            raise FakeClient.fail_with
        self.calls.append(("create_experiment", {"name": name}))
        return SimpleNamespace(experiment_id=f"exp-{name}")

    def create_recurring_run(self, **kwargs):
        self.calls.append(("create_recurring_run", kwargs))
        return SimpleNamespace(recurring_run_id="rr-1")


@pytest.fixture
def fake_kfp(monkeypatch):
    import kfp

    FakeClient.instances, FakeClient.fail_with = [], None
    monkeypatch.setattr(kfp, "Client", FakeClient)
    return FakeClient


def test_recurring_run_arguments(package):
    request = schedule.recurring_run_request("0 3 * * *", package=package, experiment="nightly", job_name="digits-nightly",
                                             params={"epochs": 3})
    client = FakeClient(host="http://kfp.example:8888")
    schedule.create_recurring_run(client, request)
    assert client.calls == [
        ("create_experiment", {"name": "nightly"}),
        ("create_recurring_run", {
            "experiment_id": "exp-nightly",
            "job_name": "digits-nightly",
            "description": "elastic-step scheduled retraining: 0 3 * * * (UTC)",
            "cron_expression": "0 0 3 * * *",
            "max_concurrency": 1,
            "no_catchup": True,
            "params": {"epochs": 3},
            "pipeline_package_path": str(package),
            "enable_caching": False,
            "enabled": True,
        }),
    ]


def test_schedule_kfp_cli(package, fake_kfp, capsys):
    code = main(["schedule", "kfp", "--host", "http://kfp.example:8888", "--cron", "0 3 * * *",
                 "--timezone", "Europe/Berlin", "--experiment", "nightly", "--package", str(package),
                 "--params", '{"epochs": 2}'])
    assert code == 0
    (client,) = fake_kfp.instances
    assert client.host == "http://kfp.example:8888"
    name, kwargs = client.calls[1]
    assert name == "create_recurring_run"
    # Berlin is UTC+1 or UTC+2 depending on today's date; KFP evaluates cron in UTC
    assert kwargs["cron_expression"] in ("0 0 2 * * *", "0 0 1 * * *")
    assert kwargs["params"] == {"epochs": 2} and kwargs["enable_caching"] is False
    out, err = capsys.readouterr()
    assert "got five fields '0 3 * * *'" in out and "rr-1" in out
    assert "daylight saving" in err


def test_schedule_kfp_cli_six_fields_as_given(package, fake_kfp, capsys):
    assert main(["schedule", "kfp", "--host", "http://h", "--cron", "0 0 9 ? * 2-6", "--package", str(package)]) == 0
    assert fake_kfp.instances[0].calls[1][1]["cron_expression"] == "0 0 9 ? * 2-6"
    assert "six fields (seconds first), used as given" in capsys.readouterr().out


@pytest.mark.parametrize("flags,message", [
    (["--cron", "0 25 * * *"], "hour 25"),
    (["--cron", "0 3 * * *", "--params", "[1]"], "JSON object"),
    (["--cron", "0 3 * * *", "--params", "{bad"], "not JSON"),
    (["--cron", "0 3 * * *", "--package", "missing.yaml"], "does not exist"),
    (["--cron", "0 3 * * *", "--timezone", "Nowhere/City"], "IANA"),
])
def test_schedule_kfp_bad_input_never_reaches_the_server(package, fake_kfp, capsys, flags, message):
    argv = ["schedule", "kfp", "--host", "http://h"] + flags
    if "--package" not in flags:
        argv += ["--package", str(package)]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert fake_kfp.instances == []


def test_schedule_kfp_unreachable_server_names_the_host(package, fake_kfp, capsys):
    fake_kfp.fail_with = ConnectionError("connection refused")
    assert main(["schedule", "kfp", "--host", "http://kfp.down:80", "--cron", "0 3 * * *",
                 "--package", str(package)]) == 1
    err = capsys.readouterr().err
    assert "http://kfp.down:80" in err and "connection refused" in err


def test_default_package_is_the_installed_compiled_pipeline(tmp_path, monkeypatch):
    (tmp_path / "compiled").mkdir()
    compiled = tmp_path / "compiled" / "retraining_pipeline.yaml"
    spec = importlib.machinery.ModuleSpec("elastic_step.pipelines", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(schedule.importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(ConfigError, match="make compile"):
        schedule.default_retraining_package()
    compiled.write_text("pipelineSpec: {}\n")
    assert schedule.default_retraining_package() == compiled


def test_finding_the_default_package_does_not_import_the_pipelines():
    code = ("import sys; from elastic_step import schedule\n"
            "try: schedule.default_retraining_package()\n"
            "except Exception: pass\n"
            "print('elastic_step.pipelines' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.stdout.strip() == "False"


def test_schedule_kfp_defaults_to_the_compiled_retraining_pipeline(fake_kfp, capsys):
    compiled = Path(__file__).resolve().parents[1] / "pipelines" / "compiled" / "retraining_pipeline.yaml"
    assert schedule.default_retraining_package().resolve() == compiled
    assert main(["schedule", "kfp", "--host", "http://h", "--cron", "0 3 * * *"]) == 0
    kwargs = fake_kfp.instances[0].calls[1][1]
    assert Path(kwargs["pipeline_package_path"]).resolve() == compiled
