"""A round's members meet on its store keys before gloo's own rendezvous, which cannot be left:
a member killed just after the master proposed the round no longer holds the others there until
the collective timeout. The meeting unit by unit (threads on one real TCPStore), then the whole
job with a real SIGKILL timed into that window."""

import os
import random
import signal
import threading
import time

import pytest
import torch.distributed as dist

from elastic_step.worker.collective import MeetingAbandoned, meet
from elastic_step.worker.loop import HOLD_BEFORE_MEETING_ENV, hold_before_meeting

from conftest import SLOW_MODEL


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield master
    del master


def meeting(port: int, prefix: str, world: int, arrive_after: list[float | None], give_up_at: list[float],
            timeout_s: float = 30.0) -> list[object]:
    """Each rank in a thread of its own, with a client of its own: it comes after its delay (None:
    never) and gives up from its time on. Returns each rank's outcome ("met", the exception, or
    None for a rank that never came)."""
    outcomes: list[object] = [None] * world
    started = time.monotonic()

    def member(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", port, is_master=False)
        time.sleep(arrive_after[rank])
        try:
            meet(dist.PrefixStore(prefix, client), rank, world,
                 lambda: time.monotonic() - started >= give_up_at[rank], timeout_s)
            outcomes[rank] = "met"
        except MeetingAbandoned as exc:
            outcomes[rank] = exc

    threads = [threading.Thread(target=member, args=(r,)) for r in range(world) if arrive_after[r] is not None]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outcomes


def test_members_that_all_come_meet(store):
    started = time.monotonic()
    assert meeting(store.port, "round-a/", 3, [0.0, 0.05, 0.1], [1e9] * 3) == ["met"] * 3
    assert time.monotonic() - started < 5  # a millisecond or so once the last one is there (generous: loaded machine)


def test_a_missing_member_is_given_up_on_once_the_master_moves_on(store):
    started = time.monotonic()
    outcomes = meeting(store.port, "round-b/", 3, [0.0, None, 0.0], [0.5, 1e9, 0.5])
    took = time.monotonic() - started
    assert outcomes[1] is None
    for outcome in (outcomes[0], outcomes[2]):
        assert isinstance(outcome, MeetingAbandoned) and "ranks [1] of 3" in str(outcome)
    assert took < 5, took  # given up at 0.5 s, not at the meeting's 30 s timeout


def test_a_missing_member_is_given_up_on_at_the_timeout(store):
    outcomes = meeting(store.port, "round-c/", 2, [0.0, None], [1e9, 1e9], timeout_s=0.3)
    assert isinstance(outcomes[0], MeetingAbandoned)


def test_every_member_obeys_one_verdict(store):
    """Whatever the timing of arrivals and give-ups, either every member that came goes ahead or
    none does: a member starting gloo's group alone would wait there for the others."""
    rng = random.Random(7)
    for trial in range(12):
        arrive = [rng.uniform(0, 0.05) for _ in range(3)]
        give_up = [rng.uniform(0, 0.06) for _ in range(3)]
        outcomes = meeting(store.port, f"round-d{trial}/", 3, arrive, give_up)
        met = [o == "met" for o in outcomes]
        assert all(met) or not any(met), (trial, arrive, give_up, outcomes)


def test_the_hold_hook_is_off_unless_it_names_this_worker():
    assert hold_before_meeting("w1.1", {}) == 0.0
    assert hold_before_meeting("w1.1", {HOLD_BEFORE_MEETING_ENV: "w0.1:30"}) == 0.0
    assert hold_before_meeting("w1.1", {HOLD_BEFORE_MEETING_ENV: "w1.1:30"}) == 30.0


@pytest.mark.e2e
def test_member_killed_after_the_round_is_ready_costs_seconds_not_the_collective_timeout(digits, start_job, monkeypatch):
    # w1.1 holds before its first meeting; it is SIGKILLed there, with the other members at the
    # meeting. Before the meeting they waited in gloo's rendezvous for the collective timeout
    # (60 s here, so that the old behaviour cannot pass for a slow machine).
    monkeypatch.setenv(HOLD_BEFORE_MEETING_ENV, "w1.1:120")
    job = start_job("--data", digits, "--workers", "2:3", "--epochs", "1", "--model-def", SLOW_MODEL,
                    "--minibatch-size", "16", "--minibatches-per-task", "2", "--collective-timeout", "60")
    status = job.wait_for(lambda s: s["round_ready"] and s["world_size"] == 3, timeout=300)  # start-up under load
    victim = next(w for w in status["workers"] if w["id"] == "w1.1")
    killed_at = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    assert job.finish() == 0, job.output()
    events = job.events()
    first_steps = [e for e in events if e["event"] == "recovered" and e["step_time"] > killed_at]
    assert first_steps, events
    took = first_steps[0]["step_time"] - killed_at
    assert took < 10, (took, first_steps[0])  # about a second; 10 for a loaded 2-core machine, against 60
