"""A worker leaves through its main thread (real processes, real signals): a background thread
that finds the master gone, or the SIGTERM thread, records why and wakes the main thread, which
unwinds through its `finally` blocks and exits with the reason's code, its logs flushed. No
background thread ends the process, except the one last resort, after LAST_RESORT_S, for a main
thread held in native code past its own timeouts. (SIGTERM's way out through the main thread is
test_worker_sigterm.py's, as PID 1 and in a job.)"""

import http.server
import subprocess
import sys
import textwrap
import threading
import time

from elastic_step.protocol import WORKER_LEFT_EXIT_CODE
from elastic_step.worker.leaving import MASTER_GONE_EXIT_CODE

# The worker's own pieces: the SIGTERM and wake-up handlers, a Heartbeat on a real MasterClient,
# and the CLI's exit path (exit_now). The main thread blocks in a system call that nothing else
# would end (a read from a pipe nobody writes), inside a `finally` that says it ran.
WORKER = textwrap.dedent("""
    import logging, os, sys, time
    from elastic_step.cli import exit_now
    from elastic_step.worker import leaving
    from elastic_step.worker.background import Heartbeat
    from elastic_step.worker.client import MasterClient

    logging.basicConfig(level=logging.WARNING, format="%(threadName)s: %(message)s")
    leaving.leave_on_sigterm()
    leaving.LAST_RESORT_S = float(sys.argv[3])
    block = sys.argv[2]

    def run():
        beat = Heartbeat(MasterClient(sys.argv[1], "t", master_timeout_s=20.0, refused_grace_s=0.5), "w0.1", 0.05)
        beat.start()
        read_fd, _ = os.pipe()
        if block == "native":  # the wake-up signal held off, as native code deaf to it would be
            import signal
            signal.pthread_sigmask(signal.SIG_BLOCK, [leaving.WAKE_SIGNAL])
        try:
            print("blocked", flush=True)
            os.read(read_fd, 1)
        finally:
            logging.getLogger("test").warning("finally ran on the main thread")
        return 0

    exit_now(leaving.run_until_leaving(run))
""")


class _Master(http.server.BaseHTTPRequestHandler):
    answered = threading.Event()

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        body = b'{"round_id": 0, "acked_step": 0, "action": "none"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.answered.set()

    def log_message(self, *args):
        pass


def start(block: str = "syscall", last_resort_s: float = 60.0):
    master = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Master)
    master.daemon_threads = True
    threading.Thread(target=master.serve_forever, daemon=True).start()
    worker = subprocess.Popen([sys.executable, "-c", WORKER, f"http://127.0.0.1:{master.server_port}", block, str(last_resort_s)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert worker.stdout.readline().strip() == "blocked"
    return master, worker


def test_a_worker_whose_master_dies_leaves_through_its_main_thread_with_code_3():
    master, worker = start()
    try:
        assert _Master.answered.wait(30)  # the heartbeat reached its master
        master.shutdown()
        master.server_close()  # nothing listens: connections are refused, the master is gone
        gone = time.monotonic()
        assert worker.wait(30) == MASTER_GONE_EXIT_CODE
        took = time.monotonic() - gone
        out = worker.stdout.read()
        # The heartbeat thread said why; the main thread unwound and logged its exit.
        assert "heartbeat: master at" in out and "refuses connections" in out, out
        assert "MainThread: finally ran on the main thread" in out, out
        assert f"MainThread: worker leaves: master at" in out and f"(exit code {MASTER_GONE_EXIT_CODE})" in out, out
        assert "last-resort" not in out and "stacks follow" not in out, out
        assert took < 15, f"{took:.1f}s"  # refused for 0.5 s counts as gone (measured under load: 0.77 s)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_a_main_thread_that_cannot_be_woken_is_ended_by_the_last_resort_with_its_stacks():
    master, worker = start(block="native", last_resort_s=0.5)
    try:
        worker.terminate()
        assert worker.wait(30) == WORKER_LEFT_EXIT_CODE
        out = worker.stdout.read()
        assert "did not leave within 0.5 s" in out and "stacks follow" in out, out
        assert "most recent call first" in out, out  # faulthandler's dump of every thread
        assert "finally ran" not in out, out
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        master.shutdown()
