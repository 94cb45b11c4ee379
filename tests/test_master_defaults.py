"""The master's and the worker client's own defaults are the ones in elastic_step/defaults.py
(a job built without TrainConfig, as the tests and benchmarks build one, behaves the same)."""

import inspect

from elastic_step import defaults
from elastic_step.master.dispatcher import Dispatcher
from elastic_step.master.state import MasterState, Timeouts
from elastic_step.worker.client import MasterClient


def default_of(function, name):
    return inspect.signature(function).parameters[name].default


def test_the_masters_and_the_clients_defaults_come_from_defaults_py():
    assert Timeouts() == Timeouts(defaults.HEARTBEAT_TIMEOUT_S, defaults.RENDEZVOUS_TIMEOUT_S, defaults.STARTUP_GRACE_S)
    assert Timeouts().startup_grace_s == 60.0
    assert default_of(MasterState, "max_relaunches") == defaults.MAX_RELAUNCHES
    assert default_of(Dispatcher, "max_task_failures") == defaults.MAX_TASK_FAILURES
    assert default_of(MasterClient, "master_timeout_s") == defaults.MASTER_TIMEOUT_S
