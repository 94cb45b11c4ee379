"""Text from a worker reaches the operator's terminal only as text: a worker's exit reason (the
last words in its log), the reasons it sends the master, its log lines, and what `get`, `list`
and `logs` print of them. `ESC ] 0 ; TITLE BEL` retitles a terminal and `ESC [ 2 J` clears it;
neither may arrive raw."""

from __future__ import annotations

import json
import time

from fastapi.testclient import TestClient

from elastic_step.backends.api import LaunchSpec
from elastic_step.backends.local import LocalBackend
from elastic_step.cli import main
from elastic_step.master.api import create_app
from elastic_step.terminal import printable

from test_master_state import make_state

HOSTILE = "\x1b]0;OWNED\x07\x1b[2J\x9b31m\rboom"
RAW = ("\x1b", "\x07", "\x9b", "\r")


def assert_no_raw_controls(text: str) -> None:
    assert not [c for c in RAW if c in text], repr(text)


def test_printable_escapes_c0_c1_and_del_but_keeps_tabs_and_line_breaks():
    assert printable(HOSTILE) == "\\x1b]0;OWNED\\x07\\x1b[2J\\x9b31m\\x0dboom"
    assert printable("a\tb\nc\x7f\x00") == "a\tb\nc\\x7f\\x00"
    assert printable("plain – ünïcode ✓") == "plain – ünïcode ✓"


def test_a_workers_reasons_reach_the_master_as_text():
    state, _ = make_state()
    client = TestClient(create_app(state, "t"))
    assert client.post("/v1/fail", headers={"Authorization": "Bearer t"}, json={"worker_id": "w0.1", "reason": HOSTILE}).status_code == 403
    for member in state.round.members:  # the first round, ready
        state.rendezvous(member, -1, [], 0)
    for member in state.round.members:
        state.rendezvous(member, -1, [], 0)
    assert client.post("/v1/fail", headers={"Authorization": "Bearer t"}, json={"worker_id": "w0.1", "reason": HOSTILE}).status_code == 200
    assert state.state == "failed" and "OWNED" in state.failure
    assert_no_raw_controls(state.failure)
    assert_no_raw_controls(json.dumps([e for e in state.events.events], ensure_ascii=False))


def test_a_worker_process_that_dies_saying_escapes_is_shown_as_text_by_get_and_logs(tmp_path, capsys):
    """A real process launched by the local backend, whose last words hold escape sequences."""
    job = tmp_path / "job"
    job.mkdir()
    # The backend runs `PYTHON -m elastic_step.cli worker`; this PYTHON does what a failing worker
    # does (its one-line error, exit 1), with its error written by someone who wants the terminal.
    worker = tmp_path / "python"
    worker.write_text("#!/bin/sh\nprintf 'elastic-step worker: error: \\033]0;OWNED\\007\\033[2J\\302\\23331m\\rboom\\n' >&2\nexit 1\n")
    worker.chmod(0o755)
    backend = LocalBackend(LaunchSpec("http://127.0.0.1:9", str(job / "token"), str(job)), python=str(worker))
    backend.launch(0, "w0.1")
    deadline = time.monotonic() + 30
    exits = []
    while not exits and time.monotonic() < deadline:
        exits = backend.poll()
        time.sleep(0.05)
    backend.shutdown(1.0)
    assert len(exits) == 1 and exits[0].returncode == 1 and "OWNED" in exits[0].reason, exits
    assert_no_raw_controls(exits[0].reason)

    # The master's final status and events as they would hold a worker's text, read by `get`,
    # `get -e` and `list`; and the worker's own log, read by `logs`.
    status = {"job": "job", "state": "failed", "failure": f"w0.1 {exits[0].reason}", "started_at": time.time() - 5,
              "ended_at": time.time(), "workers": [{"id": "w0.1", "slot": 0, "state": "gone", "exit": HOSTILE, "host": HOSTILE, "step": 0}]}
    (job / "status.json").write_text(json.dumps(status))
    (job / "events.jsonl").write_text(json.dumps({"time": time.time(), "event": "died", "worker": "w0.1", "reason": HOSTILE,
                                                  "message": HOSTILE}) + "\n")
    for argv in (["get", str(job)], ["get", str(job), "-e"], ["logs", str(job), "--worker", "w0"]):
        assert main(argv) == 0, argv
        out = capsys.readouterr()
        assert "OWNED" in out.out, (argv, out.out)  # shown, as text
        assert_no_raw_controls(out.out + out.err)
