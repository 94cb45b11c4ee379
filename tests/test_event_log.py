"""Which of the master's events reach the job's log when nobody asked for -v: a step pod's log
(`kubectl logs`, the KFP UI) is often all a person has to see why a job's group changed."""

import subprocess
import sys

EMIT = """
import contextlib, logging, sys
from elastic_step.master.events import EventLog, show_notable_events
from elastic_step.master.startup import master_log
with contextlib.ExitStack() as job:
    if sys.argv[1] == "cli":  # as `elastic-step train` without -v: the console at WARNING, the job's own master.log
        logging.basicConfig(level=logging.WARNING)
        job.enter_context(master_log(sys.argv[2]))
    show_notable_events()
    events = EventLog(None)
    events.add("joined", worker="w0-1")
    events.add("checkpoint", step=50)
    events.add("died", worker="w1-1", reason="exit code 137 (SIGKILL)")
    events.add("relaunched", worker="w1-2")
"""


def job_log(setup: str, folder) -> str:
    done = subprocess.run([sys.executable, "-c", EMIT, setup, str(folder / "master.log")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_a_death_and_a_relaunch_reach_the_log_without_verbose_and_routine_events_do_not(tmp_path):
    for setup in ("cli", "pipeline"):  # the CLI's logging, and a pipeline's process that set up none
        log = job_log(setup, tmp_path)
        assert "died" in log and "w1-1" in log and "SIGKILL" in log and "relaunched" in log, (setup, log)
        assert "joined" not in log and "checkpoint" not in log, (setup, log)
    assert "joined" in (tmp_path / "master.log").read_text()  # the job's own log keeps every event
