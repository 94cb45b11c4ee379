"""A departure (SIGTERM: an eviction, a preemption) relaunches its slot without charging
--max-relaunches, but only up to the slot's free relaunches: a worker SIGTERMed in a loop then
uses up the slot's charged relaunches and the slot is given up, as after a crash loop. The exits
are the ones the local backend reports for a real worker's SIGTERM (tests/test_worker_sigterm.py
sends the real signal); here the master's own bookkeeping is driven through many of them."""

from elastic_step.backends.api import WorkerExit
from elastic_step.protocol import WORKER_LEFT_EXIT_CODE, this_engine

from test_master_state import join_all, make_state


def sigterm_exit(worker_id: str) -> WorkerExit:
    return WorkerExit(worker_id, f"exited with code {WORKER_LEFT_EXIT_CODE} (SIGTERM)", WORKER_LEFT_EXIT_CODE,
                      relaunch="free", left=True)


def test_a_worker_sigtermed_in_a_loop_relaunches_free_up_to_the_cap_then_charged_then_its_slot_is_given_up():
    state, backend = make_state()
    state.membership.max_free_relaunches = 3
    state.membership.max_relaunches = 1
    join_all(state)
    departures = 0
    while True:
        victim = state.membership.slots[2].worker_id
        backend.exits.append(sigterm_exit(victim))
        departures += 1
        state.tick()
        if state.membership.slots[2].worker_id == victim:  # not relaunched any more
            break
        assert departures < 10, "the slot relaunches forever"
        state.register(state.membership.slots[2].worker_id, pid=1, host="h", engine=this_engine())
        state.tick()
    events = [e for e in state.events.events if e["event"] in ("relaunched", "slot_exhausted")]
    assert [e.get("counted") for e in events if e["event"] == "relaunched"] == [False, False, False, True]
    assert events[-1]["event"] == "slot_exhausted" and "3 free ones after departures" in events[-1]["message"], events
    assert departures == 5
    assert not state.failure  # the other two workers go on: the group's minimum is 2
