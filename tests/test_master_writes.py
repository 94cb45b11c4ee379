"""Nothing slow under the master's lock: every disk write the master causes (events.jsonl, the
master's log, metrics.jsonl, the audit file, a handed-over checkpoint's files) happens after the
lock is released, in the order it was decided, and a failed write fails the job."""

from __future__ import annotations

import json
import logging
import sys

from elastic_step.master.dispatcher import Dispatcher
from elastic_step.master.events import EventLog, StepLog
from elastic_step.master.ledger import Ledger
from elastic_step.master.state import MasterState, Timeouts
from elastic_step.protocol import JobState, RangeRecord, StepRecord, this_engine
from elastic_step.tracking.checkpoints import Checkpoint, write_local

from test_master_state import SPEC, RecordingBackend, join_all

WATCHED = {"state": None, "writes": []}  # what the audit hook below reports to, while a test arms it


def _on_audit_event(event: str, args) -> None:
    state = WATCHED["state"]
    if state is None or event != "open":
        return
    path, mode, flags = (list(args) + [None, None, None])[:3]
    writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & 3)
    if writing:
        WATCHED["writes"].append((f"open {path}", state.lock.held()))


sys.addaudithook(_on_audit_event)  # hooks cannot be removed; this one is idle unless armed


class WatchedFile:
    """An open file whose writes are recorded with whether the master's lock was held."""

    def __init__(self, inner, name: str, state):
        self.inner, self.name, self.state = inner, name, state

    def write(self, text):
        WATCHED["writes"].append((f"write {self.name}", self.state.lock.held()))
        return self.inner.write(text)

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


class WatchedLog(logging.Handler):
    def __init__(self, state):
        super().__init__(logging.INFO)
        self.state = state

    def emit(self, record):
        WATCHED["writes"].append((f"log {record.getMessage()[:40]}", self.state.lock.held()))


def test_no_disk_write_happens_while_the_master_holds_its_lock(tmp_path):
    order = []
    dispatcher = Dispatcher([64], ["f1"], rows_per_task=4, epochs=1, shuffle=False)
    backend = RecordingBackend()
    events = EventLog(str(tmp_path / "events.jsonl"), listener=lambda e: order.append(("event", e["event"])))
    step_log = StepLog(str(tmp_path / "metrics.jsonl"), listener=lambda e: order.append(("step", e["step"])))
    ledger = Ledger(dispatcher, str(tmp_path / "audit.jsonl"))

    def on_checkpoint(step, epoch, data, snapshot):
        audit_steps = [json.loads(line)["step"] for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
        order.append(("checkpoint", step, max(audit_steps)))
        write_local(str(tmp_path / "checkpoints"), Checkpoint(step, epoch, data, snapshot))

    state = MasterState(SPEC, dispatcher, ledger, backend, events, 2, 2, timeouts=Timeouts(startup_grace_s=30),
                        step_log=step_log, on_checkpoint=on_checkpoint)
    step_log._out = WatchedFile(step_log._out, "metrics.jsonl", state)
    ledger._audit = WatchedFile(ledger._audit, "audit.jsonl", state)
    handler = WatchedLog(state)
    logger = logging.getLogger("elastic_step")
    logger.addHandler(handler)
    previous_level = logger.level
    logger.setLevel(logging.INFO)
    WATCHED.update(state=state, writes=[])
    try:
        state.launch_all()
        for worker_id in backend.launched:
            state.register(worker_id, pid=1, host="h", engine=this_engine())
        state.tick()
        join_all(state)
        for step in range(1, 5):
            tasks = [state.next_task(m, state.ready_round_id).task for m in state.ready_round.members]
            record = StepRecord(step=step, ranges=[RangeRecord(task_id=t.id, offset=0, count=t.count) for t in tasks],
                                samples=sum(t.count for t in tasks), loss=1.0, time=float(step), checkpoint=step == 2)
            state.report_steps("w0.1", state.ready_round_id, [record])
            if step == 2:
                state.checkpoint_state("w0.1", state.ready_round_id, step, b"state")
            state.tick()
        state.request_stop()
        state.scale(2)
    finally:
        WATCHED["state"] = None
        logger.removeHandler(handler)
        logger.setLevel(previous_level)
        step_log.close()
        ledger.close()
    writes = WATCHED["writes"]
    kinds = {what.split()[0] + " " + what.split()[1].rsplit("/", 1)[-1] for what, _ in writes}
    # Every kind of write was seen, so the check below checked something.
    assert {"open events.jsonl", "write metrics.jsonl", "write audit.jsonl"} <= kinds, kinds
    assert any(what.startswith("open") and what.endswith("state.bin") for what, _ in writes), writes
    assert any(what.startswith("log") for what, _ in writes)
    under_lock = [what for what, held in writes if held]
    assert under_lock == [], under_lock
    # In the order decided: the checkpoint of step 2 after the audit line of step 2 was written,
    # steps in order, events in the order they happened.
    assert [o for o in order if o[0] == "checkpoint"] == [("checkpoint", 2, 2)], order
    assert [o[1] for o in order if o[0] == "step"] == [1, 2, 3, 4]
    assert [o[1] for o in order if o[0] == "event"] == [e["event"] for e in events.events]
    written = [json.loads(line)["event"] for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert written == [e["event"] for e in events.events]


def test_a_write_that_fails_fails_the_job_at_the_next_tick(tmp_path):
    dispatcher = Dispatcher([64], ["f1"], rows_per_task=4, epochs=1, shuffle=False)
    backend = RecordingBackend()

    def on_checkpoint(step, epoch, data, snapshot):
        raise OSError(28, "No space left on device")

    state = MasterState(SPEC, dispatcher, Ledger(dispatcher), backend, EventLog(None), 2, 2,
                        timeouts=Timeouts(startup_grace_s=30), on_checkpoint=on_checkpoint)
    state.launch_all()
    for worker_id in backend.launched:
        state.register(worker_id, pid=1, host="h", engine=this_engine())
    state.tick()
    join_all(state)
    for step in (1, 2):
        tasks = [state.next_task(m, state.ready_round_id).task for m in state.ready_round.members]
        record = StepRecord(step=step, ranges=[RangeRecord(task_id=t.id, offset=0, count=t.count) for t in tasks],
                            samples=sum(t.count for t in tasks), loss=1.0, time=float(step), checkpoint=step == 1)
        state.report_steps("w0.1", state.ready_round_id, [record])
        if step == 1:
            state.checkpoint_state("w0.1", state.ready_round_id, step, b"state")
    state.tick()  # hands the checkpoint of step 1 over; writing it fails once the lock is released
    assert state.state == JobState.RUNNING
    state.tick()
    assert state.state == JobState.FAILED
    assert "could not write the checkpoint of step 1" in state.failure and "No space left" in state.failure
