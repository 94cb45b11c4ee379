"""protocol.py is the whole vocabulary between the master and whatever reads its events: every
event kind the master records is an EventKind, and every list of kinds the readers keep (`get -e`,
MLflow's history counts, the live page) names only declared kinds, so renaming one cannot leave a
reader silently looking for a name that no longer exists."""

from __future__ import annotations

import re

import pytest

from elastic_step.master.events import EventLog
from elastic_step.protocol import EventKind


def test_every_event_kind_a_reader_looks_for_is_declared():
    from elastic_step.operate.folder import MEMBERSHIP_EVENTS
    from elastic_step.master.ui_page import PAGE
    from elastic_step.tracking.recorder import HISTORY_COUNTS

    declared = {k.value for k in EventKind}
    assert set(MEMBERSHIP_EVENTS) <= declared, set(MEMBERSHIP_EVENTS) - declared
    assert set(HISTORY_COUNTS) <= declared, set(HISTORY_COUNTS) - declared
    shown = re.search(r"const SHOWN = \[(.*?)\];", PAGE, re.S).group(1)
    page_kinds = set(re.findall(r'"([a-z_]+)"', shown)) | set(re.findall(r'e\.event === "([a-z_]+)"', PAGE))
    assert page_kinds and page_kinds <= declared, page_kinds - declared


def test_an_undeclared_event_kind_is_refused_and_a_declared_one_is_kept_by_its_plain_name():
    log = EventLog(None)
    with pytest.raises(ValueError):
        log.record("worker_exploded")
    record = log.record(EventKind.DIED, worker="w0.1")
    assert record["event"] == "died" and type(record["event"]) is str
    assert log.of(EventKind.DIED) == [record]
