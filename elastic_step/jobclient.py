"""Talking to a running job from outside (the CLI's get, top, status, scale and stop, the demo, the
tests): JOB_DIR/master.json says where the master is, JOB_DIR/token proves the caller may ask
(JOB_DIR/view-token, where only that is readable, lets it watch but not steer)."""

from __future__ import annotations

import json
import os

import httpx

from elastic_step.errors import ElasticStepError, MasterUnreachable
from elastic_step.protocol import API


class WrongToken(ElasticStepError):
    """The master answered 401: the token file is not this master's."""


def read_master_info(job_dir: str) -> dict:
    path = os.path.join(job_dir, "master.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise MasterUnreachable(f"no running job in {job_dir}: cannot read {path} ({exc})") from None


def _read_token(info: dict, job_dir: str) -> tuple[str, bool]:
    """The job token, else the read-only one; and whether it is the read-only one."""
    problems = []
    for key in ("token_file", "view_token_file"):
        path = info.get(key)
        if not path:
            continue
        try:
            with open(path) as f:
                return f.read().strip(), key == "view_token_file"
        except OSError as exc:
            problems.append(f"{path}: {exc.strerror}")
    raise MasterUnreachable(f"cannot read the job's token in {job_dir} ({'; '.join(problems) or 'master.json names none'}); "
                            "run this as the user who started the job")


class JobClient:
    def __init__(self, job_dir: str, timeout_s: float = 5.0):
        self.job_dir = job_dir
        self.info = read_master_info(job_dir)
        try:
            token, self.read_only = _read_token(self.info, job_dir)
            url = self.info["url"]
        except KeyError as exc:
            raise MasterUnreachable(f"no running job in {job_dir}: master.json lacks {exc}") from None
        self._http = httpx.Client(base_url=url + API, headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s)

    def _call(self, method: str, path: str, body=None, params=None) -> dict:
        try:
            reply = self._http.request(method, path, json=body, params=params)
        except httpx.TimeoutException as exc:
            raise MasterUnreachable(
                f"the master of the job in {self.job_dir} at {self.info['url']} does not answer ({type(exc).__name__}); "
                "it may be overloaded or paused: try again, or check its process") from None
        except httpx.HTTPError as exc:
            raise MasterUnreachable(f"the job in {self.job_dir} is not running (master {self.info['url']}: {exc})") from None
        if reply.status_code == 401 and self.read_only and method != "GET":
            raise WrongToken(f"only the job's read-only token is readable here, and it cannot steer the job; "
                             f"run this as the user who can read {self.info.get('token_file')}")
        if reply.status_code == 401:
            raise WrongToken(f"the master at {self.info['url']} refused the token in {self.job_dir}: it belongs to another "
                             "run of the job; read the token files of the job folder this master wrote")
        if reply.status_code >= 400:
            try:
                detail = reply.json().get("detail", reply.text)
            except ValueError:
                detail = reply.text[:300]
            raise ElasticStepError(f"the master refused: {detail}")
        return reply.json()

    def status(self) -> dict:
        return self._call("GET", "/status")

    def events(self, since: int = 0) -> dict:
        return self._call("GET", "/events", params={"since": since})

    def history(self) -> dict:
        return self._call("GET", "/history")

    def scale(self, workers: int) -> dict:
        return self._call("POST", "/scale", {"workers": workers})

    def stop(self) -> dict:
        return self._call("POST", "/stop")

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
