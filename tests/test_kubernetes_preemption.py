"""A worker the cluster took away (preempted, evicted, its node lost: a free relaunch) is not the
data's fault: the tasks it held go back without a failure charged to them, so spot preemptions
never end a job with "check that shard". A worker that failed on its own still charges them."""

from elastic_step.backends.api import Backend, WorkerExit
from elastic_step.master.dispatcher import Dispatcher
from elastic_step.master.events import EventLog
from elastic_step.master.ledger import Ledger
from elastic_step.master.state import MasterState, Timeouts
from elastic_step.protocol import JobSpec, this_engine

SPEC = JobSpec(job_name="t", model_def="m", manifest="d", minibatch_size=2, seed=0, store_host="127.0.0.1",
               store_port=1, collective_timeout_s=5, heartbeat_interval_s=0.1, master_timeout_s=5, features=[], label="y")


class Cluster(Backend):
    """Launches nothing; exits are what the test says the cluster did."""

    name = "cluster"

    def __init__(self):
        self.launched, self.exits = [], []

    def launch(self, slot, worker_id):
        self.launched.append(worker_id)

    def poll(self):
        exits, self.exits = self.exits, []
        return exits

    def stop(self, worker_id):
        self.exits.append(WorkerExit(worker_id, "deleted by the master", None, "count"))

    def shutdown(self, grace_s, members=None):
        pass


def settle(state, cluster, registered: set) -> None:
    """Every launched worker registers and every round member calls in until a round is ready."""
    for _ in range(4):
        for worker_id in cluster.launched:
            if worker_id not in registered:
                registered.add(worker_id)
                state.register(worker_id, pid=1, host="h", engine=this_engine())
        state.tick()
        if state.over:
            return
        for worker_id in cluster.launched:  # the last member to call in completes the round
            if state.workers[worker_id].alive:
                state.rendezvous(worker_id, -1, [], 0)


def rounds_of_losses(relaunch: str, losses: int = 3):
    """Three workers; `losses` times the worker holding the first task is taken away mid-task
    (a free relaunch: the cluster did it; a counted one: the worker crashed)."""
    dispatcher = Dispatcher([12], ["f1"], rows_per_task=4, epochs=1, shuffle=False)
    cluster = Cluster()
    state = MasterState(SPEC, dispatcher, Ledger(dispatcher), cluster, EventLog(None), 2, 3, max_relaunches=10,
                        timeouts=Timeouts(heartbeat_s=60, rendezvous_s=60, startup_grace_s=60))
    state.launch_all()
    registered: set[str] = set()
    settle(state, cluster, registered)
    first = None
    for _ in range(losses):
        assert state.round.ready
        victim = state.round.members[-1]
        held = state.next_task(victim, state.round.id).task
        first = first or held
        assert (held.shard, held.start) == (first.shard, first.start)  # the same rows each time
        cluster.exits.append(WorkerExit(victim, f"pod of {victim} preempted by a higher-priority pod", None, relaunch))
        settle(state, cluster, registered)
        if state.over:
            break
    return state, held


def test_three_preemptions_of_the_holder_charge_its_task_nothing_and_the_job_goes_on():
    state, held = rounds_of_losses("free")
    assert state.state == "running", state.failure
    assert state.dispatcher.tasks[held.id].failures == 0
    assert len(state.events.of("relaunched")) == 3


def test_three_crashes_of_the_holder_still_fail_the_task():
    state, _ = rounds_of_losses("count")
    assert state.state == "failed" and "check that shard" in state.failure
