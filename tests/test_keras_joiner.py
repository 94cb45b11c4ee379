"""A relaunched worker registers seconds before it can train (a Keras worker imports TensorFlow
after registering): the master counts it into rounds only once it calls in to rendezvous, so
the survivors never wait at a rendezvous for a joiner that is still importing. The master's
state machine is driven directly here; test_keras runs it with real processes."""

from test_master_state import join_all, make_state

from elastic_step.backends.api import WorkerExit
from elastic_step.protocol import this_engine


def lose_rank_1(state, backend):
    join_all(state)
    backend.exits.append(WorkerExit("w1.1", "killed by SIGKILL", -9))
    state.tick()
    join_all(state, steps={"w0.1": 0, "w2.1": 0}, left=state.round.id - 1)
    assert state.round.ready and "w1.1" not in state.round.members
    assert "w1.2" in backend.launched
    state.register("w1.2", pid=2, host="h", engine=this_engine())


def test_a_registered_joiner_enters_a_round_only_once_it_calls_in():
    state, backend = make_state()
    lose_rank_1(state, backend)
    survivors_round = state.round.id
    for _ in range(3):  # registered and heartbeating, still importing its framework
        state.heartbeat("w1.2", -1)
        state.tick()
    assert state.round.id == survivors_round and "w1.2" not in state.round.members

    assert state.rendezvous("w1.2", -1, [], 0).status == "wait"  # ready now
    assert [e["worker"] for e in state.events.of("ready")][-1] == "w1.2"
    state.tick()
    assert state.round.id == survivors_round + 1 and state.round.members == ["w0.1", "w2.1", "w1.2"]
    # The survivors hold step 0 (no step reported yet; a source ahead of the ledger with no
    # record of its steps fails the job, which test_master_hardening covers).
    replies = join_all(state, steps={"w0.1": 0, "w2.1": 0})
    assert not state.over
    assert state.round.ready and replies["w1.2"].rank == 2 and replies["w1.2"].source_rank == 0


def test_a_regroup_while_a_joiner_is_not_ready_goes_on_without_it():
    state, backend = make_state(workers=4, minimum=2)
    lose_rank_1(state, backend)  # survivors w0.1, w2.1, w3.1
    backend.exits.append(WorkerExit("w3.1", "killed by SIGKILL", -9))
    state.tick()
    assert state.round.members == ["w0.1", "w2.1"]  # w1.2 registered, not ready: left out
    join_all(state, steps={"w0.1": 0, "w2.1": 0}, left=state.round.id - 1)
    assert not state.over and state.round.ready  # formed without waiting for w1.2
    state.rendezvous("w1.2", -1, [], 0)
    state.tick()
    assert state.round.members == ["w0.1", "w2.1", "w1.2"]
