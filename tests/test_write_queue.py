"""The master's queued writes: in order, one writer at a time, and a call waits only for what it
queued (and what was queued before it). A checkpoint's write that waits on the network (a
parameter-server cut whose shard is stopped) must not hold heartbeats and task requests."""

import threading
import time

import pytest
from fastapi.testclient import TestClient

from elastic_step.master.api import create_app
from elastic_step.master.writes import MasterLock

from test_master_state import join_all, make_state

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def blocked_write(lock: MasterLock, done: list) -> tuple[threading.Thread, threading.Event]:
    """A thread that queues a write which waits until released (a cut waiting on a stopped
    shard); returns the thread and, once the write is under way, its release."""
    started, release = threading.Event(), threading.Event()

    def write():
        started.set()
        release.wait(30)
        done.append("slow")

    def queue_it():
        with lock:
            lock.writes.put("write slowly", write)

    thread = threading.Thread(target=queue_it)
    thread.start()
    assert started.wait(5)
    return thread, release


def test_a_call_that_queued_nothing_returns_while_another_threads_write_is_under_way():
    lock, done = MasterLock(), []
    thread, release = blocked_write(lock, done)
    began = time.monotonic()
    with lock:
        pass  # a heartbeat that changes nothing on disk
    assert time.monotonic() - began < 4.0  # the slow write goes on until released: a call that waited would not return
    release.set()
    thread.join(5)
    assert done == ["slow"]


def test_a_call_that_queued_a_write_waits_for_it_and_for_every_write_queued_before_it():
    lock, done = MasterLock(), []
    thread, release = blocked_write(lock, done)
    finished = []

    def queue_mine():
        with lock:
            lock.writes.put("write mine", lambda: done.append("mine"))
        finished.append(list(done))  # what was written when this call returned

    mine = threading.Thread(target=queue_mine)
    mine.start()
    mine.join(0.5)
    assert mine.is_alive() and done == []  # queued after the slow write: it waits for it
    release.set()
    mine.join(5)
    thread.join(5)
    assert finished == [["slow", "mine"]]  # in the order queued, both on disk when it returned


def test_flush_runs_every_write_queued_by_any_thread():
    lock, done = MasterLock(), []
    thread, release = blocked_write(lock, done)
    threading.Timer(0.3, release.set).start()
    lock.writes.flush()
    assert done == ["slow"]
    thread.join(5)


def test_a_write_that_queues_a_write_has_it_run_after_it_and_flush_waits_for_both():
    lock, done = MasterLock(), []

    def outer():
        done.append("outer")
        with lock:  # a checkpoint's write records its event under the lock
            lock.writes.put("write the event", lambda: done.append("event"))
        done.append("outer returned")  # the write did not wait for its own event

    with lock:
        lock.writes.put("write outer", outer)
    lock.writes.flush()
    assert done == ["outer", "outer returned", "event"]


def test_a_call_waits_for_its_writes_only_so_long_and_they_run_later_in_their_turn():
    lock, done = MasterLock(), []
    lock.writes.wait_s = 0.3
    thread, release = blocked_write(lock, done)
    began = time.monotonic()
    with lock:
        lock.writes.put("write mine", lambda: done.append("mine"))
    assert 0.25 < time.monotonic() - began < 10.0 and done == []  # a step report answered, its line not yet written
    release.set()
    lock.writes.flush()
    assert done == ["slow", "mine"]
    thread.join(5)


def test_a_failed_write_is_remembered_and_the_next_ones_still_run():
    lock, done = MasterLock(), []

    def fails():
        raise OSError("disk full")

    with lock:
        lock.writes.put("append to the audit file", fails)
        lock.writes.put("write event x", lambda: done.append("x"))
    assert done == ["x"]  # the call waited for both
    assert lock.writes.error == "could not append to the audit file: OSError: disk full"


def test_heartbeats_and_task_requests_are_answered_while_a_checkpoint_write_waits():
    state, _ = make_state()
    join_all(state)
    client, done = TestClient(create_app(state, TOKEN)), []
    state.lock.writes.wait_s = 60.0  # a call that waited for the slow write would wait until it is released
    thread, release = blocked_write(state.lock, done)
    try:
        member = state.round.members[1]
        for path, body in [("/v1/heartbeat", {"worker_id": member, "round_id": state.round.id, "step": -1}),
                           ("/v1/task", {"worker_id": member, "round_id": state.round.id}),
                           ("/v1/status", None)]:
            began = time.monotonic()
            response = client.post(path, headers=AUTH, json=body) if body else client.get(path, headers=AUTH)
            assert response.status_code == 200, (path, response.text)
            assert time.monotonic() - began < 10.0, path
        assert done == []  # the write was still waiting all along
    finally:
        release.set()
        thread.join(5)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the ended writer, on purpose
def test_a_writer_ended_by_what_no_write_catches_is_replaced_by_the_next_write():
    lock, done, ended = MasterLock(), [], []

    def ends_the_thread():
        ended.append(threading.current_thread())
        raise SystemExit  # no write catches it: it ends the writer thread

    with lock:
        lock.writes.put("end the writer", ends_the_thread)
    ended[0].join(5)  # its end reported within this test
    with lock:
        lock.writes.put("write after it", lambda: done.append("after"))
    lock.writes.flush()
    assert done == ["after"]
