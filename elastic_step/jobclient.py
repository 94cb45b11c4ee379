"""Talking to a running job from outside (the CLI's status and scale, the demo, the tests):
JOB_DIR/master.json says where the master is, JOB_DIR/token proves the caller may ask."""

from __future__ import annotations

import json
import os

import httpx

from elastic_step.errors import ElasticStepError, MasterUnreachable
from elastic_step.protocol import API


class JobClient:
    def __init__(self, job_dir: str, timeout_s: float = 5.0):
        self.job_dir = job_dir
        path = os.path.join(job_dir, "master.json")
        try:
            with open(path) as f:
                self.info = json.load(f)
            with open(self.info["token_file"]) as f:
                token = f.read().strip()
        except (OSError, ValueError, KeyError) as exc:
            raise MasterUnreachable(f"no running job in {job_dir}: cannot read {path} ({exc})") from None
        self._http = httpx.Client(base_url=self.info["url"] + API, headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s)

    def _call(self, method: str, path: str, body=None) -> dict:
        try:
            reply = self._http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise MasterUnreachable(f"the job in {self.job_dir} is not running (master {self.info['url']}: {exc})") from None
        if reply.status_code >= 400:
            raise ElasticStepError(f"the master refused: {reply.json().get('detail', reply.text)}")
        return reply.json()

    def status(self) -> dict:
        return self._call("GET", "/status")

    def scale(self, workers: int) -> dict:
        return self._call("POST", "/scale", {"workers": workers})

    def close(self) -> None:
        self._http.close()


def try_status(job_dir: str) -> dict | None:
    """The job's status, or None while it is not (or no longer) reachable."""
    try:
        client = JobClient(job_dir)
    except MasterUnreachable:
        return None
    try:
        return client.status()
    except ElasticStepError:
        return None
    finally:
        client.close()
