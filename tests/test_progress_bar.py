"""The master's progress bar on a terminal (a pseudo-terminal here, as a person's shell gives
one) with log lines arriving while it is shown: a worker's death, a warning."""

import os
import pty
import re
import subprocess
import sys

SHOW_A_BAR_AND_LOG = r"""
import logging, time
from elastic_step.defaults import LOG_FORMAT
logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)  # as the CLI sets it up
from elastic_step.master.events import show_notable_events
from elastic_step.master.progress import ProgressDisplay
show_notable_events()  # as a job does: its notable events at INFO
status = {"rows_done": 10, "rows_total": 100, "epoch": 0, "epochs": 2, "world_size": 2, "round": 1, "loss": 0.5,
          "samples_per_s": 100.0}
with ProgressDisplay(True) as bar:
    bar.update(status)
    time.sleep(0.3)  # drawn
    logging.getLogger("elastic_step.events").info("died {\"worker\": \"w1.1\"}")
    logging.getLogger("elastic_step.master").warning("checkpoint of step 8 not taken")
    status["rows_done"] = 20
    bar.update(status)
    time.sleep(0.3)
logging.getLogger("elastic_step.master").warning("after the bar")
"""


def on_a_terminal(code: str) -> str:
    """What a terminal shows of `code`'s stdout and stderr, its escape sequences taken out."""
    leader, follower = pty.openpty()
    env = dict(os.environ, COLUMNS="120", TERM="xterm")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=follower, stdout=follower, stderr=follower, env=env)
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the process closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    assert proc.wait(timeout=60) == 0, shown.decode(errors="replace")
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown.decode(errors="replace"))


def test_log_lines_while_the_bar_is_shown_print_whole_lines_above_it():
    lines = re.split(r"[\r\n]", on_a_terminal(SHOW_A_BAR_AND_LOG))
    logged = [line for line in lines if "elastic_step." in line]
    # Each log line on a line of its own, from its timestamp: not run on from the end of the bar's.
    assert len(logged) == 3 and all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ", line) for line in logged), logged
    assert "died" in logged[0] and "not taken" in logged[1] and "after the bar" in logged[2]
    assert any(line.startswith("training") and "20/100" in line for line in lines)  # the bar went on
