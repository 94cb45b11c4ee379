"""A job folder is trusted only as far as it must be. `list`, `get`, `top` and `stop` send the job's
token to the address in master.json: a folder someone crafted (master.json naming a secret of the
caller's as the token file, and a listener of theirs as the master) must get nothing out of them.
The token comes only from the folder's own `token`/`view-token` (never through a link), the folder
must be the caller's, and a local job's master must be on this machine."""

from __future__ import annotations

import json
import os
import socket
import threading

import pytest

from elastic_step.cli import main

SECRET = "the-callers-secret-do-not-send"


class Listener:
    """A TCP listener on 127.0.0.1 that records every byte anyone sends it."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.received = b""
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.settimeout(1)
            try:
                while chunk := conn.recv(65536):
                    self.received += chunk
            except OSError:
                pass
            finally:
                conn.close()

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def listener():
    it = Listener()
    yield it
    it.close()


def crafted_folder(root, name: str, url: str, token_link: bool = False):
    """A job folder as someone could write it: master.json names the caller's secret as token files."""
    secret = root / "secret.txt"
    secret.write_text(SECRET + "\n")
    job = root / "jobs" / name
    job.mkdir(parents=True)
    (job / "master.json").write_text(json.dumps({
        "url": url, "job": name, "backend": "local", "started_at": 1.0,
        "token_file": str(secret), "view_token_file": str(secret)}))
    if token_link:
        (job / "token").symlink_to(secret)
        (job / "view-token").symlink_to(secret)
    return job


def every_command(job) -> list[list[str]]:
    root = str(job.parent)
    return [["list", "--root", root], ["get", str(job)], ["get", job.name, "--root", root],
            ["top", str(job), "--iterations", "1"], ["stop", str(job)]]


@pytest.mark.parametrize("token_link", [False, True], ids=["token-file-named-in-master.json", "token-a-symlink"])
def test_a_crafted_job_folder_sends_no_token_to_its_listener(tmp_path, listener, capsys, token_link):
    job = crafted_folder(tmp_path, "crafted", f"http://127.0.0.1:{listener.port}", token_link=token_link)
    for argv in every_command(job):
        main(argv)
    out = capsys.readouterr()
    assert listener.received == b"" and listener.connections == 0, listener.received[:300]
    assert SECRET not in out.out + out.err
    assert "cannot read the job's token" in out.err


def test_a_job_folder_of_another_user_is_refused(tmp_path, listener, capsys, monkeypatch):
    job = crafted_folder(tmp_path, "theirs", f"http://127.0.0.1:{listener.port}")
    (job / "token").write_text("their-token")  # theirs to send, but the caller would be asking their master
    if os.geteuid() == 0:
        os.chown(job, 65534, 65534)  # nobody's
    else:  # a folder owned by another user cannot be made without root: the caller becomes another uid
        uid = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    code = main(["get", str(job)])
    err = capsys.readouterr().err
    assert code != 0 and "belongs to another user" in err and len(err.strip().splitlines()) == 1, err
    main(["stop", str(job)])
    assert listener.connections == 0


def test_a_local_jobs_master_must_be_on_this_machine(tmp_path, capsys):
    job = crafted_folder(tmp_path, "far", "http://192.0.2.7:8000")  # TEST-NET-1: no address of this machine
    (job / "token").write_text("a-token")
    code = main(["get", str(job)])
    err = capsys.readouterr().err
    assert code != 0 and "192.0.2.7, which is not this machine" in err, err
