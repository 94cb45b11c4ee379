"""Talking to a running job from outside (the CLI's get, top, status, scale and stop, the demo, the
tests): JOB_DIR/master.json says where the master is, JOB_DIR/token proves the caller may ask
(JOB_DIR/view-token, where only that is readable, lets it watch but not steer).

A job folder is trusted only as far as it must be: it must be the caller's own, the tokens are
read from the folder itself (never a path master.json names, never through a link), and a local
job's master must be on this machine. Otherwise a folder someone else wrote could send the
caller's token to a listener of theirs."""

from __future__ import annotations

import errno
import ipaddress
import json
import os
from urllib.parse import urlsplit

import httpx

from elastic_step.errors import ElasticStepError, MasterUnreachable
from elastic_step.operate.documents import checked_events, checked_status
from elastic_step.protocol import API, Route


class WrongToken(ElasticStepError):
    """The master answered 401: the token file is not this master's."""


class JobFolderRefused(ElasticStepError):
    """The job folder is not one this caller may act through: another user's, its token files
    not readable as the caller's own, or master.json naming a master that cannot be the job's."""


# The token files a job folder holds, the job token first (it steers; the view token only watches).
TOKEN_FILES = (("token", False), ("view-token", True))
# Hosts a job of the local backend may name in master.json besides this machine's own addresses.
LOOPBACK_NAMES = ("localhost",)


def check_own_folder(job_dir: str) -> None:
    """Refuse a job folder someone else owns: its master.json could send this caller's token to
    an address of their choosing."""
    try:
        owner = os.stat(job_dir).st_uid
    except OSError as exc:
        raise MasterUnreachable(f"cannot read the job folder {job_dir} ({exc.strerror})") from None
    if owner != os.getuid():
        raise JobFolderRefused(f"the job folder {job_dir} belongs to another user (uid {owner}); "
                                "only the user who started a job may talk to its master through its folder")


def read_master_info(job_dir: str) -> dict:
    check_own_folder(job_dir)
    path = os.path.join(job_dir, "master.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:  # a master removes it as it exits
        raise MasterUnreachable(f"no running job in {job_dir}: without its master.json, its master is not running "
                                "(it has ended, or never started); `elastic-step get` shows how a job ended") from None
    except (OSError, ValueError) as exc:
        raise MasterUnreachable(f"no running job in {job_dir}: cannot read {path} ({exc})") from None


def read_token_file(path: str) -> str:
    """A token file the caller owns, never through a symbolic link."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, encoding="utf-8") as f:
        if os.fstat(f.fileno()).st_uid != os.getuid():
            raise PermissionError(errno.EPERM, "owned by another user")
        return f.read().strip()


def _read_token(job_dir: str) -> tuple[str, bool]:
    """The job token, else the read-only one, from the job folder itself (never a path master.json
    names); and whether it is the read-only one."""
    problems = []
    for name, read_only in TOKEN_FILES:
        path = os.path.join(job_dir, name)
        try:
            return read_token_file(path), read_only
        except OSError as exc:
            problems.append(f"{path}: {exc.strerror or exc}")
    raise JobFolderRefused(f"cannot read the job's token in {job_dir} ({'; '.join(problems)}); "
                            "run this as the user who started the job")


def this_machine(host: str) -> bool:
    """Whether `host` is a loopback address or an address of this machine."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False  # a name: it could resolve anywhere
    if address.is_loopback:
        return True
    import psutil

    return any(a.address.split("%")[0] == str(address) for nics in psutil.net_if_addrs().values() for a in nics)


def check_master_url(info: dict, job_dir: str) -> str:
    """The master's address from master.json; for a local job, only one on this machine (a local
    master and its workers are processes here, so any other address is not theirs)."""
    url = info["url"]
    parsed = urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise JobFolderRefused(f"master.json in {job_dir} names no master address ({url!r}); the job's master wrote another")
    if info.get("backend", "local") == "local" and not this_machine(parsed.hostname):
        raise JobFolderRefused(f"master.json in {job_dir} puts the local job's master at {parsed.hostname}, which is not "
                                "this machine; a local master listens here, so this folder was not written by one")
    return url


class JobClient:
    def __init__(self, job_dir: str, timeout_s: float = 5.0):
        self.job_dir = job_dir
        self.info = read_master_info(job_dir)
        try:
            url = check_master_url(self.info, job_dir)
            token, self.read_only = _read_token(job_dir)
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
                             f"run this as the user who can read {os.path.join(self.job_dir, 'token')}")
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
        return checked_status(self._call("GET", Route.STATUS), f"the reply of the master at {self.info['url']}")

    def events(self, since: int = 0) -> dict:
        reply = self._call("GET", Route.EVENTS, params={"since": since})
        return {**reply, "events": checked_events(reply.get("events"))}

    def history(self) -> dict:
        return self._call("GET", Route.HISTORY)

    def scale(self, workers: int) -> dict:
        return checked_status(self._call("POST", Route.SCALE, {"workers": workers}), f"the master at {self.info['url']}")

    def scale_ps(self, shards: int) -> dict:
        """`scale --ps`: the master's answer once the move is done (the job and what moved, `ps_scale`)."""
        return self._call("POST", Route.SCALE_PS, {"shards": shards})

    def stop(self) -> dict:
        return checked_status(self._call("POST", Route.STOP), f"the master at {self.info['url']}")

    def close(self) -> None:
        self._http.close()


def try_status(job_dir: str) -> dict | None:
    """The job's status, or None while it is not (or no longer) reachable."""
    try:
        client = JobClient(job_dir)
    except (MasterUnreachable, JobFolderRefused):
        return None
    try:
        return client.status()
    except ElasticStepError:
        return None
    finally:
        client.close()
