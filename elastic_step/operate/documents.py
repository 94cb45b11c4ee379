"""What a master says about its job, checked as it is read: /status, status.json and a published
status ConfigMap against protocol.JobStatus, events (events.jsonl, /events, the published list)
against protocol.EventRecord. Readers keep the plain JSON shape (what `-o json` prints), with
every field they use of the right type: a field of another type is refused in one line naming
where it came from, rather than failing later in a table."""

from __future__ import annotations

from pydantic import ValidationError

from elastic_step.errors import ElasticStepError
from elastic_step.protocol import EventRecord, JobStatus


class UnreadableStatus(ElasticStepError):
    """A job's status that is not what a master writes (another release, or edited by hand)."""


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"]) or "the document"
    return f"{where}: {error['msg']}"


def checked_status(data, source: str) -> dict:
    """`data` as a JobStatus, in its JSON shape (only the fields it had, so a reader tells an
    absent field from a null one); `source` names where it was read, for the error."""
    try:
        return JobStatus.model_validate(data).model_dump(mode="json", exclude_unset=True)
    except ValidationError as exc:
        raise UnreadableStatus(f"{source} holds no job status a master of this release writes ({_first_error(exc)}); "
                               "read it with the elastic-step release that runs the job") from None


def checked_events(records) -> list[dict]:
    """The records that are events; one of a kind this release does not know (a newer master's),
    or torn, is left out rather than failing the whole list."""
    if not isinstance(records, list):
        return []
    events = []
    for record in records:
        try:
            events.append(EventRecord.model_validate(record).model_dump(mode="json", exclude_unset=True))
        except ValidationError:
            continue
    return events
