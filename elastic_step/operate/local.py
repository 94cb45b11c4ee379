"""Jobs of the local backend: a job is its folder (or its name under a root folder of job
folders), read from the files its master keeps there and asked through its master's API."""

from __future__ import annotations

import os
import time
from typing import Callable, Iterator

from elastic_step.errors import ElasticStepError
from elastic_step.operate.api import PS_MOVE_TIMEOUT_S, JobOperator, LivePage, LogRequest
from elastic_step.operate.client import JobClient
from elastic_step.operate.folder import find_job, job_view, list_local, load_job
from elastic_step.operate.logfiles import follow, log_path, read_log

POLL_S = 0.5


class LocalJobs(JobOperator):
    def __init__(self, root: str | None = None):
        self.root = root

    def jobs(self) -> list[dict]:
        return [{**row, "where": row.get("note") or row.get("job_dir", "")} for row in list_local(self.root or ".")]

    def locate(self, job: str) -> str:
        return find_job(job, self.root)

    def view(self, job: str, with_events: bool = False) -> dict:
        return job_view(self.locate(job), with_events=with_events)

    def stop(self, job: str, timeout_s: float, wait: bool, say: Callable[[str], None]) -> str:
        job_dir = self.locate(job)
        loaded = load_job(job_dir, with_events=False)
        if not loaded["live"]:
            state = (loaded["result"] or {}).get("state") or loaded["status"].get("state")
            raise ElasticStepError(f"job {loaded['status'].get('job')} has ended ({state}); there is nothing to stop")
        name = self._ask(job_dir, lambda client: client.stop())["job"]
        say(f"stopping job {name}: the workers checkpoint their next step, then stop")
        if not wait:
            return f"asked job {name} to stop"
        return _wait_stopped(job_dir, name, timeout_s)

    def scale(self, job: str, workers: int) -> str:
        status = self._ask(self.locate(job), lambda client: client.scale(workers))
        return f"scaling job {status['job']} to {status['target_workers']} workers"

    def scale_ps(self, job: str, shards: int) -> dict:
        status = self._ask(self.locate(job), lambda client: client.scale_ps(shards), timeout_s=PS_MOVE_TIMEOUT_S)
        return {"job": status["job"], "ps_scale": status["ps_scale"]}

    @staticmethod
    def _ask(job_dir: str, call, timeout_s: float = 5.0) -> dict:
        client = JobClient(job_dir, timeout_s=timeout_s)
        try:
            return call(client)
        finally:
            client.close()

    def log_lines(self, job: str, request: LogRequest) -> Iterator[str]:
        job_dir = self.locate(job)
        path = log_path(job_dir, request.worker, request.worker is None, request.previous)
        lines, offset = read_log(path, tail=request.tail, since_s=request.since_s, timestamps=request.timestamps)
        yield from lines
        if request.follow:
            def running() -> bool:
                return not any(os.path.exists(os.path.join(job_dir, name)) for name in ("status.json", "result.json"))

            yield from follow(path, offset, request.timestamps, running)

    def live_page(self, job: str) -> LivePage:
        summary = self.view(job)["summary"]
        if not summary.get("ui"):
            raise ElasticStepError(f"job {summary['job']} is not running ({summary['state']}): only a running master "
                                   "serves its live page; `elastic-step get` shows how it ended")
        return LivePage(describe=f"job {summary['job']} ({summary['job_dir']})", url=summary["ui"])


def _wait_stopped(job_dir: str, name: str, timeout_s: float) -> str:
    """Until the job in `job_dir` ended: its outcome, for people; an error unless it stopped."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            job = load_job(job_dir, with_events=False)
        except ElasticStepError:
            job = None  # between the master's end and its final status
        if job is not None and not job["live"]:
            result = job["result"] or {}
            state = result.get("state") or job["status"].get("state")
            if state == "stopped" and not result:
                time.sleep(POLL_S)  # the master still records the stop in MLflow; result.json follows
                continue
            if state != "stopped":
                raise ElasticStepError(f"job {name} ended {state}, not stopped: {job['status'].get('failure', '')}")
            return (f"job {name} stopped at its checkpoint of step {result.get('checkpoint_step')}; "
                    "`elastic-step train` with the same options and --resume continues it")
        time.sleep(POLL_S)
    raise ElasticStepError(f"job {name} did not stop within {timeout_s:.0f}s; see `elastic-step get {job_dir} -e`")
