"""Scheduled retraining: cron expressions for Argo (five fields) and KFP (six, seconds first),
and the recurring run of the compiled retraining pipeline on a KFP server.

Argo's CronWorkflow takes the standard five fields (minute hour day-of-month month day-of-week);
KFP's recurring runs take six, seconds first (robfig/cron with seconds). People write five, so
`kfp_cron` prepends `0` and accepts six as they are, and always says which one it got.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone as dt_timezone
from pathlib import Path
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from elastic_step.errors import ConfigError

MONTHS = "JAN FEB MAR APR MAY JUN JUL AUG SEP OCT NOV DEC".split()
WEEKDAYS = "SUN MON TUE WED THU FRI SAT".split()

# (name, lowest, highest, names for values, whether `?` may stand for "any")
_SECONDS = ("second", 0, 59, None, False)
_FIELDS = (
    ("minute", 0, 59, None, False),
    ("hour", 0, 23, None, False),
    ("day-of-month", 1, 31, None, True),
    ("month", 1, 12, MONTHS, False),
    ("day-of-week", 0, 6, WEEKDAYS, True),
)
UTC_NAMES = {"UTC", "Etc/UTC", "Z", "GMT", "Etc/GMT"}


@dataclass(frozen=True)
class KfpCron:
    """A cron expression in KFP's six-field form, and how it was obtained from the input."""

    expression: str
    given_fields: int  # 5 or 6
    note: str  # one line for the user: what was given and what KFP gets


def _value(text: str, spec, expr: str) -> int:
    name, low, high, names, _ = spec
    if names and text.upper() in names:
        return names.index(text.upper()) + low
    if not text.isdigit():
        raise ConfigError(f"cron {expr!r}: {name} field has {text!r}, which is not a number"
                          + (f" or a name ({', '.join(names[:3])}, ...)" if names else ""))
    number = int(text)
    if not low <= number <= high:
        raise ConfigError(f"cron {expr!r}: {name} {number} is out of range {low}-{high}")
    return number


def _check_field(text: str, spec, expr: str) -> set[int]:
    """Validate one field (lists, ranges, steps, `*`, `?`) and return the values it selects."""
    name, low, high, _, allows_any = spec
    selected: set[int] = set()
    for item in text.split(","):
        base, _, step_text = item.partition("/")
        step = 1
        if step_text or item.endswith("/"):
            if not step_text.isdigit() or int(step_text) == 0:
                raise ConfigError(f"cron {expr!r}: {name} step in {item!r} must be a positive number")
            step = int(step_text)
        if base == "*" or (base == "?" and allows_any):
            first, last = low, high
        elif base == "?":
            raise ConfigError(f"cron {expr!r}: `?` is only allowed in day-of-month and day-of-week, not {name}")
        elif "-" in base:
            start, _, end = base.partition("-")
            first, last = _value(start, spec, expr), _value(end, spec, expr)
            if first > last:
                raise ConfigError(f"cron {expr!r}: {name} range {base!r} runs backwards")
        elif base:
            first = _value(base, spec, expr)
            last = high if step_text else first
        else:
            raise ConfigError(f"cron {expr!r}: {name} field has an empty item in {text!r}")
        selected.update(range(first, last + 1, step))
    return selected


def _split(expr: str) -> list[str]:
    if not isinstance(expr, str) or not expr.strip():
        raise ConfigError("cron expression is empty: give five fields, e.g. '0 3 * * *' (03:00 every day)")
    if expr.strip().startswith("@"):
        raise ConfigError(f"cron {expr!r}: write the schedule as fields, e.g. '0 3 * * *' for @daily at 03:00")
    return expr.split()


def argo_cron(expr: str) -> str:
    """A valid five-field expression for an Argo CronWorkflow, normalised to single spaces."""
    fields = _split(expr)
    if len(fields) == 6:
        raise ConfigError(f"cron {expr!r} has six fields (KFP's form, seconds first); an Argo CronWorkflow takes "
                          f"five: drop the seconds, e.g. {' '.join(fields[1:])!r}")
    if len(fields) != 5:
        raise ConfigError(f"cron {expr!r} has {len(fields)} fields; give five: minute hour day-of-month month day-of-week")
    for text, spec in zip(fields, _FIELDS):
        _check_field(text, spec, expr)
    return " ".join(fields)


def kfp_cron(expr: str) -> KfpCron:
    """KFP's six-field form of a five-field expression (seconds `0` prepended); six fields as given."""
    fields = _split(expr)
    if len(fields) == 5:
        argo_cron(expr)
        six = "0 " + " ".join(fields)
        return KfpCron(six, 5, f"got five fields {' '.join(fields)!r}; KFP takes six (seconds first): {six!r}")
    if len(fields) == 6:
        _check_field(fields[0], _SECONDS, expr)
        for text, spec in zip(fields[1:], _FIELDS):
            _check_field(text, spec, expr)
        six = " ".join(fields)
        return KfpCron(six, 6, f"got six fields (seconds first), used as given: {six!r}")
    raise ConfigError(f"cron {expr!r} has {len(fields)} fields; give five (minute hour day-of-month month "
                      "day-of-week) or KFP's six (seconds first)")


def _zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ConfigError(f"--timezone {name!r} is not an IANA time zone; use a name like UTC or Europe/Berlin") from None


def check_timezone(name: str) -> str:
    _zone(name)
    return name


def shift_to_utc(six: str, tz: str, now: datetime | None = None) -> tuple[str, str | None]:
    """Rewrite a six-field expression written in zone `tz` to UTC, which is where KFP's scheduler
    evaluates cron by default (it has no per-run time zone). Returns the expression and a warning
    when the zone observes daylight saving time (the run then moves by the DST difference)."""
    if tz in UTC_NAMES:
        return six, None
    zone = _zone(tz)
    now = now or datetime.now(dt_timezone.utc)
    offset = now.astimezone(zone).utcoffset() or timedelta(0)
    minutes = int(offset.total_seconds() // 60)
    fields = six.split()
    if minutes % 60:
        raise ConfigError(f"--timezone {tz}: its UTC offset ({minutes:+d} min) is not whole hours; "
                          "write the cron expression in UTC and leave --timezone at UTC")
    hours = minutes // 60
    selected = _check_field(fields[2], _FIELDS[1], six)
    shifted = sorted((h - hours) % 24 for h in selected)
    crosses_midnight = any(not 0 <= h - hours <= 23 for h in selected)
    if crosses_midnight and any(f not in ("*", "?") for f in fields[3:]):
        raise ConfigError(f"--timezone {tz}: shifting {six!r} to UTC moves it across midnight, which would change "
                          "its day fields; write the cron expression in UTC and leave --timezone at UTC")
    fields[2] = "*" if len(shifted) == 24 else ",".join(str(h) for h in shifted)
    year = now.year
    january, july = (zone.utcoffset(datetime(year, m, 1)) for m in (1, 7))
    warning = None
    if january != july:
        warning = (f"{tz} observes daylight saving time; KFP evaluates cron in UTC, so the run moves by an hour "
                   f"when the clocks change (shifted with today's offset, UTC{hours:+d})")
    return " ".join(fields), warning


def default_retraining_package() -> Path:
    """The compiled retraining pipeline shipped in elastic_step.pipelines, found without importing
    that package (the core does not import pipelines)."""
    spec = importlib.util.find_spec("elastic_step.pipelines")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / "compiled" / "retraining_pipeline.yaml"
        if candidate.is_file():
            return candidate
    raise ConfigError("no compiled retraining pipeline (pipelines/compiled/retraining_pipeline.yaml) in this "
                      "installation: run `make compile`, or pass --package PATH")


@dataclass
class RecurringRunRequest:
    """Everything `kfp.Client.create_recurring_run` is called with (apart from the experiment id)."""

    job_name: str
    cron: KfpCron
    experiment: str
    package: Path
    timezone: str = "UTC"
    params: dict = field(default_factory=dict)
    description: str = ""
    warnings: list[str] = field(default_factory=list)


def recurring_run_request(cron: str, *, package: str | Path | None = None, experiment: str = "elastic-step-retraining",
                          job_name: str = "elastic-step-retraining", timezone: str = "UTC",
                          params: dict | None = None, now: datetime | None = None) -> RecurringRunRequest:
    """Validate everything before any call to the server, so a bad input changes nothing there."""
    converted = kfp_cron(cron)
    check_timezone(timezone)
    expression, warning = shift_to_utc(converted.expression, timezone, now)
    note = converted.note
    if expression != converted.expression:
        note += f"; in UTC (KFP's scheduler zone) from {timezone}: {expression!r}"
    path = Path(package) if package else default_retraining_package()
    if not path.is_file():
        raise ConfigError(f"--package {str(path)!r} does not exist; give a compiled pipeline YAML (make compile writes "
                          "pipelines/compiled/retraining_pipeline.yaml)")
    if not job_name:
        raise ConfigError("--name is empty; give the recurring run a name")
    return RecurringRunRequest(job_name=job_name, cron=KfpCron(expression, converted.given_fields, note),
                               experiment=experiment, package=path, timezone=timezone, params=dict(params or {}),
                               description=f"elastic-step scheduled retraining: {cron.strip()} ({timezone})",
                               warnings=[warning] if warning else [])


def create_recurring_run(client, request: RecurringRunRequest):
    """Create the recurring run on a KFP server through `client` (a `kfp.Client`): one run at a
    time, no backfill of missed intervals, caching off so every run retrains on fresh data."""
    experiment = client.create_experiment(name=request.experiment)
    return client.create_recurring_run(
        experiment_id=experiment.experiment_id,
        job_name=request.job_name,
        description=request.description,
        cron_expression=request.cron.expression,
        max_concurrency=1,
        no_catchup=True,
        params=request.params,
        pipeline_package_path=str(request.package),
        enable_caching=False,
        enabled=True,
    )
