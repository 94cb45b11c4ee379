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


def test_the_api_clients_name_routes_only_through_the_route_enum():
    """The worker and the operating commands call the master's routes as Route members, so a route
    renamed in protocol.py cannot leave a client calling a path the master no longer serves."""
    import ast
    from pathlib import Path

    from elastic_step.protocol import Route

    package = Path(__file__).resolve().parents[1] / "elastic_step"
    paths = {r.value for r in Route}
    literal = []
    for source in [*sorted((package / "worker").glob("*.py")), *sorted((package / "operate").glob("*.py"))]:
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Constant) and node.value in paths:
                literal.append(f"{source.relative_to(package.parent)}:{node.lineno}: {node.value!r}")
    assert not literal, "\n".join(literal)
