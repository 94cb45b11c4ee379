"""`get`, `list`, `logs` and `stop` on bad input, each a one-line message that says what to do and
a non-zero exit: an unknown job, a wrong token, a master that refuses or does not answer, a job
that died without a final status; an ended job shows its final state. And the log files: which
attempt `--worker`/`--previous` mean, `--tail`, `--since`, `--timestamps`."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest
import uvicorn

from elastic_step.cli import main
from elastic_step.operate.logfiles import log_path, parse_since, read_log
from elastic_step.master.api import create_app, server_config

from test_master_state import make_state


def one_line_error(capsys, *argv) -> str:
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1, err
    return err


def write_master_json(job_dir, url: str, token: str = "right", view: str = "view") -> None:
    os.makedirs(job_dir, exist_ok=True)
    (job_dir / "token").write_text(token)
    (job_dir / "view-token").write_text(view)
    (job_dir / "master.json").write_text(json.dumps({
        "url": url, "job": "j", "token_file": str(job_dir / "token"), "view_token_file": str(job_dir / "view-token"),
        "backend": "local", "started_at": time.time() - 5, "mlflow": {"run_id": "r" * 32, "tracking_uri": "http://mlflow:5000",
                                                                      "ui": "http://mlflow:5000/#/experiments/1/runs/" + "r" * 32}}))


@pytest.fixture
def master():
    """A real master API (its state driven in process) on a free port of 127.0.0.1."""
    state, _ = make_state()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(server_config(create_app(state, "right", "view")))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", state
    server.should_exit = True
    thread.join(5)
    sock.close()


def test_an_unknown_job_says_where_it_looked_and_what_to_pass(capsys, tmp_path):
    err = one_line_error(capsys, "get", "nope", "--root", str(tmp_path))
    assert "no job 'nope'" in err and "--job-dir" in err and "elastic-step list" in err
    assert "no job" in one_line_error(capsys, "logs", str(tmp_path / "missing"))
    assert "no job" in one_line_error(capsys, "stop", str(tmp_path / "missing"))


def test_a_live_master_is_shown_by_job_name_under_its_root(capsys, tmp_path, master):
    url, state = master
    write_master_json(tmp_path / "j", url)
    state.heartbeat("w0.1", 3)
    assert main(["get", "j", "--root", str(tmp_path), "-o", "json"]) == 0
    view = json.loads(capsys.readouterr().out)
    assert view["summary"]["state"] == "running" and view["summary"]["ui"] == f"{url}/ui#token=view"
    assert view["summary"]["mlflow"]["ui"].startswith("http://mlflow:5000/#/experiments/1/runs/")
    assert [w["id"] for w in view["workers"]] == ["w0.1", "w1.1", "w2.1"]
    assert main(["get", str(tmp_path / "j")]) == 0
    out = capsys.readouterr().out
    assert "job t: running" in out and "http://mlflow:5000/#/experiments/1/runs/" in out and "live page" in out


def test_the_view_token_watches_but_cannot_steer(capsys, tmp_path, master):
    url, state = master
    write_master_json(tmp_path / "j", url)
    os.remove(tmp_path / "j" / "token")  # only the read-only token is readable
    assert main(["get", str(tmp_path / "j")]) == 0
    capsys.readouterr()
    err = one_line_error(capsys, "stop", str(tmp_path / "j"))
    assert "read-only token" in err and "cannot steer" in err and state.stop_request is None


def test_a_wrong_token_says_whose_it_is(capsys, tmp_path, master):
    url, _ = master
    write_master_json(tmp_path / "j", url, token="stale", view="stale")
    err = one_line_error(capsys, "get", str(tmp_path / "j"))
    assert "refused the token" in err and "another run" in err


def test_a_master_that_refuses_connections_without_a_final_status_says_resume(capsys, tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    write_master_json(tmp_path / "j", f"http://127.0.0.1:{port}")
    err = one_line_error(capsys, "get", str(tmp_path / "j"))
    assert "not running" in err and "--resume" in err


def test_a_master_that_does_not_answer_says_so(capsys, tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)  # accepts, never answers
    try:
        write_master_json(tmp_path / "j", f"http://127.0.0.1:{sock.getsockname()[1]}")
        start = time.monotonic()
        err = one_line_error(capsys, "get", str(tmp_path / "j"))
        assert "does not answer" in err and time.monotonic() - start < 30
    finally:
        sock.close()


def test_an_ended_job_shows_its_final_state_not_an_error(capsys, tmp_path):
    job = tmp_path / "j"
    write_master_json(job, "http://127.0.0.1:9")
    state, _ = make_state()
    state.fail("only 1 workers left and fewer than --workers minimum 2")
    (job / "status.json").write_text(json.dumps({**state.status(), "ended_at": time.time()}))
    assert main(["get", str(job), "-o", "yaml"]) == 0
    out = capsys.readouterr().out
    assert "state: failed" in out and "fewer than --workers minimum" in out
    assert main(["get", str(job)]) == 0
    out = capsys.readouterr().out
    assert "job t: failed" in out and "ended" in out and "live page" not in out


def make_logs(job_dir) -> None:
    logs = job_dir / "logs"
    os.makedirs(logs)
    now = time.time()
    old = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now - 3600))
    new = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now - 5))
    (logs / "w1.1.log").write_text(f"{old},100 INFO first attempt\nTraceback (most recent call last):\n  boom\n")
    (logs / "w1.2.log").write_text(f"{old},200 INFO second attempt\n{new},300 INFO still here\npartial line without end")
    (logs / "w0.1.log").write_text("x\n")
    (logs / "master.log").write_text(f"{new},000 INFO master\n")
    (job_dir / "events.jsonl").write_text("")


def test_which_log_a_worker_or_slot_means(tmp_path):
    make_logs(tmp_path)
    base = tmp_path / "logs"
    assert log_path(str(tmp_path), "w1", False, False) == str(base / "w1.2.log")
    assert log_path(str(tmp_path), "1", False, False) == str(base / "w1.2.log")
    assert log_path(str(tmp_path), "w1", False, True) == str(base / "w1.1.log")
    assert log_path(str(tmp_path), "w1.2", False, True) == str(base / "w1.1.log")
    assert log_path(str(tmp_path), None, True, False) == str(base / "master.log")
    with pytest.raises(Exception, match="first attempt: there is no previous one"):
        log_path(str(tmp_path), "w0", False, True)
    with pytest.raises(Exception, match="slots with logs: w0, w1"):
        log_path(str(tmp_path), "w7", False, False)
    with pytest.raises(Exception, match="names no worker"):
        log_path(str(tmp_path), "../../etc/passwd", False, False)


def test_tail_since_and_timestamps(tmp_path, capsys):
    make_logs(tmp_path)
    path = str(tmp_path / "logs" / "w1.2.log")
    lines, offset = read_log(path)
    assert lines[-1].endswith("still here") and offset == len(open(path, "rb").read()) - len(b"partial line without end")
    assert read_log(path, tail=1)[0] == [lines[-1]]
    assert read_log(path, tail=0)[0] == []
    assert read_log(path, since_s=60)[0] == [lines[-1]]
    traceback = read_log(str(tmp_path / "logs" / "w1.1.log"), since_s=2 * 3600, timestamps=True)[0]
    assert len(traceback) == 3 and all(line[:4].isdigit() for line in traceback)  # its lines take the record's time
    assert parse_since("5m") == 300 and parse_since("1.5h") == 5400
    err = one_line_error(capsys, "logs", str(tmp_path), "--since", "five minutes")
    assert "30s, 5m, 2h or 1d" in err
    assert main(["logs", str(tmp_path), "--worker", "w1", "--previous", "--tail", "2"]) == 0
    assert capsys.readouterr().out.splitlines() == ["Traceback (most recent call last):", "  boom"]


def test_list_shows_live_ended_and_unreachable_jobs(tmp_path, capsys, master):
    url, _ = master
    write_master_json(tmp_path / "a-live", url)
    write_master_json(tmp_path / "b-gone", "http://127.0.0.1:9")
    os.makedirs(tmp_path / "not-a-job")
    assert main(["list", "--root", str(tmp_path), "-o", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["job"], r["state"]) for r in rows] == [("t", "running"), ("b-gone", "unreachable")]
    assert rows[0]["workers_live"] == 3 and rows[0]["target_workers"] == 3
