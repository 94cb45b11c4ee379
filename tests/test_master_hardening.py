"""The master against clients that are wrong or hostile: workers of an earlier attempt, members
asking for what only rank 0 may do, step reports the ledger must not half-take, late checkpoint
uploads, and the data plane (the TCPStore) closed to everyone but the round's members. Also a
token holder trying to end the job with one request (a second registration, a late pre-flight
failure), bodies larger than the master takes, and connections that ask nothing."""

import contextlib
import socket
import threading
import time

import httpx
import psutil
import pytest
from fastapi.testclient import TestClient

from elastic_step.backends.api import WorkerExit
from elastic_step.master.api import MAX_JSON_BYTES, MAX_STATE_BYTES, SERVER_LIMITS, create_app, server_config
from elastic_step.master.connections import REQUEST_DEADLINE_S, per_peer_limit
from elastic_step.master.store import RendezvousStore
from elastic_step.master.dispatcher import Dispatcher
from elastic_step.master.events import EventLog
from elastic_step.master.ledger import Ledger
from elastic_step.master.state import MasterState, Timeouts
from elastic_step.protocol import RangeRecord, StepRecord, this_engine

from test_master_state import SPEC, RecordingBackend, join_all

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Job:
    """A master with three workers in a ready first round, driven in process, with its API."""

    def __init__(self, checkpoints=False):
        self.committed = []  # (step, state) of every checkpoint handed over
        self.dispatcher = Dispatcher([24], ["f1"], rows_per_task=4, epochs=1, shuffle=False)
        self.backend = RecordingBackend()
        self.state = MasterState(
            SPEC, self.dispatcher, Ledger(self.dispatcher), self.backend, EventLog(None), 2, 3,
            timeouts=Timeouts(heartbeat_s=30, rendezvous_s=30, startup_grace_s=30),
            on_checkpoint=(lambda step, epoch, state, ledger: self.committed.append((step, state))) if checkpoints else None,
        )
        self.state.launch_all()
        for worker_id in self.backend.launched:
            self.state.register(worker_id, pid=1, host="h", engine=this_engine())
        self.state.tick()
        join_all(self.state)
        self.api = TestClient(create_app(self.state, TOKEN))

    @property
    def round_id(self):
        return self.state.round.id

    def tasks(self):
        """One task for each member, by rank."""
        return [self.state.next_task(m, self.round_id).task for m in self.state.round.members]

    def kill(self, worker_id):
        self.backend.exits.append(WorkerExit(worker_id, "killed by SIGKILL", -9))
        self.state.tick()

    def post(self, path, body):
        return self.api.post(f"/v1/{path}", headers=AUTH, json=body)


def step(n, *ranges, checkpoint=False):
    """Step n's record: one (task, offset, count) or None per rank."""
    return StepRecord(
        step=n, ranges=[RangeRecord(task_id=r[0], offset=r[1], count=r[2]) if r else None for r in ranges],
        samples=sum(r[2] for r in ranges if r), loss=1.0, time=time.time(), checkpoint=checkpoint,
    )


def dumped(*records):
    return [r.model_dump(mode="json") for r in records]


# -- only current members may change anything ---------------------------------------------------
def test_a_gone_worker_of_an_earlier_attempt_can_change_nothing():
    job = Job()
    t0, t1, t2 = job.tasks()
    round_id = job.round_id
    job.kill("w2.1")  # w2.1 is gone (its slot relaunched as w2.2); a stale copy of it still calls
    assert "w2.2" in job.backend.launched
    before = (job.state.state, job.state.round.id, job.dispatcher.tasks[t2.id].failures, job.state.ledger.applied_step)
    refusals = [
        job.post("fail", {"worker_id": "w2.1", "reason": "stale"}),
        job.post("collective-failed", {"worker_id": "w2.1", "round_id": round_id, "error": "x"}),
        job.post("task-failed", {"worker_id": "w2.1", "task_id": t2.id, "error": "x"}),
        job.post("steps", {"worker_id": "w2.1", "round_id": round_id, "steps": dumped(step(1, (t0.id, 0, 2), None, None))}),
        job.post("fail", {"worker_id": "intruder", "reason": "never launched"}),
        job.api.put("/v1/model", headers=AUTH, params={"worker_id": "w2.1", "step": 0}, content=b"x"),
        job.api.put("/v1/checkpoint", headers=AUTH, params={"worker_id": "w2.1", "round_id": round_id, "step": 1}, content=b"x"),
    ]
    for response in refusals:
        assert response.status_code == 403, response.text
        assert "not a live worker of this job" in response.json()["detail"]
    job.state.tick()
    after = (job.state.state, job.state.round.id, job.dispatcher.tasks[t2.id].failures, job.state.ledger.applied_step)
    assert after == before


def test_a_live_worker_outside_the_round_cannot_fail_the_job_or_report_steps():
    job = Job()
    t0, t1, t2 = job.tasks()
    job.kill("w2.1")
    job.state.register("w2.2", pid=1, host="h", engine=this_engine())  # the relaunched worker is live, not yet a member
    assert job.post("fail", {"worker_id": "w2.2", "reason": "x"}).status_code == 403
    # rank 1 is a member, but only rank 0 reports steps
    response = job.post("steps", {"worker_id": "w1.1", "round_id": job.state.ready_round_id,
                                  "steps": dumped(step(1, (t0.id, 0, 2), (t1.id, 0, 2), None))})
    assert response.status_code == 403 and "only rank 0" in response.json()["detail"]
    assert job.state.state == "running" and job.state.ledger.applied_step == 0


def test_a_live_worker_cannot_register_again_so_a_fake_engine_cannot_end_the_job():
    job = Job()
    register = {"worker_id": "w0.1", "pid": 1, "host": "h", "engine": this_engine().model_dump()}
    fake = {**register, "engine": {"release": "0.0.1", "protocol": "0" * 16}}
    for body in (fake, {**register, "pid": 4242}, {**register, "host": "elsewhere"}):
        response = job.post("register", body)
        assert response.status_code == 409 and "has registered already" in response.json()["detail"], response.text
    assert job.state.state == "running" and job.state.failure == ""
    assert (job.state.workers["w0.1"].pid, job.state.workers["w0.1"].host) == (1, "h")
    # the worker's own registration, repeated (a retry whose reply was lost), is answered again
    assert job.post("register", register).json()["job_name"] == SPEC.job_name
    assert job.state.state == "running"


def test_a_preflight_failure_is_taken_only_before_the_worker_joins_a_round():
    job = Job()  # every worker has called in to the first round: each passed its pre-flight check
    response = job.post("preflight-failed", {"worker_id": "w0.1", "reason": "no GPU"})
    assert response.status_code == 409 and "passed its pre-flight check" in response.json()["detail"]
    assert job.state.state == "running"
    job.kill("w2.1")
    job.state.register("w2.2", pid=1, host="h", engine=this_engine())  # relaunched, checking itself
    assert job.post("preflight-failed", {"worker_id": "w2.2", "reason": "no GPU"}).status_code == 200
    assert job.state.state == "failed" and "w2.2 failed its pre-flight check: no GPU" in job.state.failure


def test_a_member_can_still_fail_the_job_with_its_reason():
    job = Job()
    assert job.post("fail", {"worker_id": "w0.1", "reason": "loss is nan"}).status_code == 200
    assert job.state.state == "failed" and "loss is nan" in job.state.failure


def test_refusals_are_declared_in_the_openapi_document():
    job = Job()
    paths = job.api.get("/openapi.json", headers=AUTH).json()["paths"]
    for path, method, codes in [("/v1/fail", "post", {"401", "403", "422"}), ("/v1/steps", "post", {"401", "403", "409", "422"}),
                                ("/v1/collective-failed", "post", {"401", "403", "422"}),
                                ("/v1/checkpoint", "put", {"401", "403", "409", "422"}), ("/v1/scale", "post", {"401", "409", "422"})]:
        assert codes <= set(paths[path][method]["responses"]), (path, paths[path][method]["responses"].keys())


# -- strict requests ---------------------------------------------------------------------------
@pytest.mark.parametrize("path,body", [
    ("task", {"worker_id": "w0.1", "round_id": "1"}),  # a string where an integer belongs
    ("task", {"worker_id": "w0.1", "round_id": True}),  # a boolean where an integer belongs
    ("task", {"worker_id": "w0.1", "round_id": 1.5}),  # a fraction where an integer belongs (1.0 is an integer)
    ("task", {"worker_id": "w0.1", "round_id": -1}),
    ("task", {"worker_id": "w0.1", "round_id": 1, "extra": True}),  # a field the protocol does not name
    ("task", {"worker_id": "", "round_id": 1}),
    ("task", {"worker_id": "w0.1\n", "round_id": 1}),
    ("task-failed", {"worker_id": "w0.1", "task_id": -3, "error": "x"}),
    ("heartbeat", {"worker_id": "w0.1", "step": -2}),
    ("steps", {"worker_id": "w0.1", "round_id": 1, "steps": []}),
    ("steps", {"worker_id": "w0.1", "round_id": 1, "steps": [{"step": 1, "ranges": [None] * 4097, "samples": 0, "loss": 0.0, "time": 1.0}]}),
    ("steps", {"worker_id": "w0.1", "round_id": 1, "steps": [{"step": 1, "ranges": [{"task_id": 0, "offset": 0, "count": 0}], "samples": 0, "loss": 0.0, "time": 1.0}]}),
    ("steps", {"worker_id": "w0.1", "round_id": 1, "steps": [{"step": 1, "ranges": [None], "samples": -1, "loss": 0.0, "time": 1.0}]}),
    ("scale", {"workers": 2**40}),
])
def test_schema_violating_requests_are_422_and_change_nothing(path, body):
    job = Job()
    before = job.state.status()
    response = job.post(path, body)
    assert response.status_code == 422, response.text
    assert job.state.status() == before


# -- the ledger takes a step whole or not at all ---------------------------------------------------
def test_a_step_naming_one_task_twice_is_refused_whole_and_fails_the_job_clearly():
    job = Job()
    t0, t1, t2 = job.tasks()
    response = job.post("steps", {"worker_id": "w0.1", "round_id": job.round_id,
                                  "steps": dumped(step(1, (t0.id, 0, 2), (t0.id, 2, 2), None))})
    assert response.status_code == 409
    assert job.dispatcher.tasks[t0.id].applied == 0 and job.state.ledger.applied_step == 0  # nothing half-applied
    assert job.state.state == "failed" and "named twice" in job.state.failure and "--resume" in job.state.failure


def test_a_step_claiming_rows_of_a_task_another_member_holds_is_refused():
    job = Job()
    t0, t1, t2 = job.tasks()
    # rank 0 claims rank 1's task as its own
    response = job.post("steps", {"worker_id": "w0.1", "round_id": job.round_id,
                                  "steps": dumped(step(1, (t1.id, 0, 2), None, None))})
    assert response.status_code == 409 and "held by w1.1" in response.json()["detail"]
    assert job.dispatcher.tasks[t1.id].applied == 0 and job.state.ledger.applied_step == 0


def test_a_lost_step_report_does_not_stall_the_ledger_the_next_round_fills_the_gap():
    job = Job()
    t0, t1, t2 = job.tasks()
    round_id = job.round_id
    s1 = step(1, (t0.id, 0, 2), (t1.id, 0, 2), (t2.id, 0, 2))
    s2 = step(2, (t0.id, 2, 2), (t1.id, 2, 2), (t2.id, 2, 2))
    # the report of step 1 was lost; step 2's arrives
    response = job.post("steps", {"worker_id": "w0.1", "round_id": round_id, "steps": dumped(s2)})
    assert response.status_code == 409 and "regroups" in response.json()["detail"]
    job.state.tick()
    assert job.state.round.id > round_id  # a regroup, not a stall
    members = job.state.round.members
    join_all(job.state, steps={m: 2 for m in members}, unacked={m: [s1, s2] for m in members}, left=round_id)
    assert job.state.round.ready and job.state.round.start_step == 2
    assert job.state.ledger.applied_step == 2
    assert job.state.state == "running"


def test_workers_forget_a_step_only_once_it_is_final():
    # A reported step may still be voided by a regroup, and the next round then trains a
    # different step of the same number: acknowledging the first would make every rank forget
    # the second's ranges, and the master could never learn them.
    job = Job()
    t0, t1, t2 = job.tasks()
    s1 = step(1, (t0.id, 0, 2), (t1.id, 0, 2), (t2.id, 0, 2))
    s2 = step(2, (t0.id, 2, 2), (t1.id, 2, 2), (t2.id, 2, 2))
    job.post("steps", {"worker_id": "w0.1", "round_id": job.round_id, "steps": dumped(s1)})
    assert job.state.heartbeat("w1.1", 1).acked_step == 0
    job.post("steps", {"worker_id": "w0.1", "round_id": job.round_id, "steps": dumped(s2)})
    assert job.state.heartbeat("w1.1", 2).acked_step == 1


def test_a_state_source_without_the_records_of_its_steps_fails_the_job_instead_of_double_counting():
    job = Job()
    first = job.round_id
    job.kill("w2.1")
    # the survivors are at step 3, but nobody reported steps 1..3 and nobody holds their ranges
    join_all(job.state, steps={"w0.1": 3, "w1.1": 3}, left=first)
    assert job.state.state == "failed" and "holds no record of steps 1..3" in job.state.failure


# -- checkpoints are bound to the round and its rank 0 -----------------------------------------------
def test_a_late_checkpoint_upload_from_an_earlier_round_is_refused_and_never_paired():
    job = Job(checkpoints=True)
    t0, t1, t2 = job.tasks()
    first = job.round_id
    job.kill("w0.1")  # rank 0 of round 1 is partitioned away and dropped
    job.state.register("w0.2", pid=1, host="h", engine=this_engine())
    for _ in range(2):
        job.state.tick()
    join_all(job.state, left=first)
    second = job.round_id
    assert second > first and job.state.round.ready
    put = lambda worker, round_id, n: job.api.put(  # noqa: E731
        "/v1/checkpoint", headers=AUTH, params={"worker_id": worker, "round_id": round_id, "step": n}, content=b"stale")
    assert put("w0.1", first, 1).status_code == 403  # the old rank 0, late
    rank0, rank1 = job.state.round.members[:2]
    assert put(rank1, second, 1).status_code == 403  # not rank 0
    assert put(rank0, first, 1).status_code == 409  # rank 0 now, but naming the old round
    # the current rank 0 checkpoints step 1 of this round: only its state pairs with the ledger
    tasks = job.tasks()
    assert put(rank0, second, 1).status_code == 200
    s1 = step(1, *[(t.id, 0, 2) for t in tasks], checkpoint=True)
    s2 = step(2, *[(t.id, 2, 2) for t in tasks])
    assert job.post("steps", {"worker_id": rank0, "round_id": second, "steps": dumped(s1, s2)}).status_code == 200
    job.state.tick()
    assert job.committed == [(1, b"stale")]  # the one upload accepted, from this round's rank 0


# -- the settle -----------------------------------------------------------------------------------
def test_the_start_step_stays_voidable_until_its_source_has_broadcast_it():
    job = Job()
    t0, t1, t2 = job.tasks()
    first = job.round_id
    s1 = step(1, (t0.id, 0, 2), (t1.id, 0, 2), (t2.id, 0, 2))
    s2 = step(2, (t0.id, 2, 2), (t1.id, 2, 2), (t2.id, 2, 2))
    assert job.post("steps", {"worker_id": "w0.1", "round_id": first, "steps": dumped(s1, s2)}).status_code == 200
    # w2.1 died in step 2's collective; w0.1 applied step 2, w1.1 did not
    job.kill("w2.1")
    join_all(job.state, steps={"w0.1": 2, "w1.1": 1}, unacked={"w0.1": [s2], "w1.1": [s2]}, left=first)
    second = job.state.round
    assert second.ready and second.start_step == 2 and second.members[second.source_rank] == "w0.1"
    # the source dies before its broadcast reached anyone: nobody else holds step 2
    job.kill("w0.1")
    for joiner in ("w0.2", "w2.2"):  # relaunched, and ready to train
        job.state.register(joiner, pid=1, host="h", engine=this_engine())
        job.state.rendezvous(joiner, -1, [], 0)
    job.state.tick()
    join_all(job.state, steps={"w1.1": 1}, left=second.id)
    third = job.state.round
    assert job.state.state == "running", job.state.failure
    assert third.ready and third.start_step == 1 and third.members[third.source_rank] == "w1.1"
    assert job.state.ledger.applied_step == 1
    assert all(job.dispatcher.tasks[t.id].applied == 2 for t in (t0, t1, t2))  # step 2's rows went back


# -- the data plane -------------------------------------------------------------------------------
def test_round_store_prefixes_are_secret_and_only_in_the_members_rendezvous_reply():
    job = Job()
    first = job.state.round
    job.kill("w2.1")
    job.state.register("w2.2", pid=1, host="h", engine=this_engine())
    for _ in range(2):
        job.state.tick()
    replies = join_all(job.state, left=first.id)
    second = job.state.round
    prefixes = {first.store_prefix, second.store_prefix}
    assert len(prefixes) == 2
    for prefix, round_ in ((first.store_prefix, first), (second.store_prefix, second)):
        secret = prefix.removeprefix("round-").removesuffix("/")
        assert len(secret) == 32 and int(secret, 16) >= 0  # 128 random bits, not the round's number
        assert prefix != f"round-{round_.id}/"
    assert {r.store_prefix for r in replies.values()} == {second.store_prefix}
    # nowhere else: not in the status, not in the events, not to a stranger
    published = repr(job.state.status()) + repr(job.state.events.events)
    assert not any(p in published for p in prefixes)
    stranger = job.post("rendezvous", {"worker_id": "w9.1", "step": -1}).json()
    assert stranger["status"] == "stop" and stranger["store_prefix"] == ""
    assert job.api.post("/v1/rendezvous", json={"worker_id": "w0.1", "step": -1}).status_code == 401


def test_the_store_listens_on_the_api_host_only():
    # 127.0.0.2 is this machine too (all of 127/8 is loopback), so a store listening on every
    # interface would answer on 127.0.0.1 as well.
    store = RendezvousStore("127.0.0.2")
    try:
        listening = [c for c in psutil.Process().net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port]
        assert [c.laddr.ip for c in listening] == ["127.0.0.2"]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", store.port), timeout=2).close()
        import torch.distributed as dist

        client = dist.TCPStore("127.0.0.2", store.port, is_master=False, timeout=__import__("datetime").timedelta(seconds=5))
        client.set("round-x/key", "value")
        assert store.store.get("round-x/key") == b"value"
    finally:
        store.close()


def test_the_api_server_answers_503_beyond_its_connection_limit(monkeypatch):
    monkeypatch.setitem(SERVER_LIMITS, "limit_concurrency", 2)
    job = Job()
    with served(job) as port:
        url = f"http://127.0.0.1:{port}/v1"
        # two workers of the round wait at a rendezvous that cannot complete (long polls)
        job.state.request_regroup("test")
        job.state.tick()
        waiting = [threading.Thread(target=httpx.post, args=(f"{url}/rendezvous",),
                                    kwargs={"json": {"worker_id": m, "step": 0}, "headers": AUTH, "timeout": 5})
                   for m in job.state.round.members[:2]]
        for t in waiting:
            t.start()
        # once both long polls hold their connections, a third request is turned away (they may
        # take a while to connect on a loaded machine; they wait up to 5 s)
        deadline, answers = time.monotonic() + 4, []
        while 503 not in answers and time.monotonic() < deadline:
            answers.append(httpx.get(f"{url}/status", headers=AUTH).status_code)
            time.sleep(0.05)
        assert answers[-1] == 503, answers
        for t in waiting:
            t.join()
        assert httpx.get(f"{url}/status", headers=AUTH).status_code == 200


# -- bodies and connections, against the real server -----------------------------------------------
@contextlib.contextmanager
def served(job):
    """The job's API served by uvicorn as the master serves it, on a free port of 127.0.0.1."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = __import__("uvicorn").Server(server_config(create_app(job.state, TOKEN)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(5)


def raw_request(port: int, head: str, body: bytes = b"", source: str = "127.0.0.1") -> bytes:
    """Send a request's head (and the start of its body, if any) and read the answer, without
    ever sending the rest of the body its Content-Length announces."""
    with socket.create_connection(("127.0.0.1", port), timeout=REQUEST_DEADLINE_S + 5, source_address=(source, 0)) as s:
        s.sendall(head.encode() + b"\r\n" + body)
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer


def put_head(path: str, length: int) -> str:
    return (f"PUT {path} HTTP/1.1\r\nHost: master\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {length}\r\n")


def test_an_upload_is_refused_before_its_body_is_read_and_an_oversized_one_is_413():
    job = Job(checkpoints=True)
    rank0, rank1 = job.state.round.members[:2]
    with served(job) as port:
        # A member that is not rank 0 announces 1 GiB and sends 4 bytes: refused at once, unread
        # (a server that read the body first would still be waiting for it).
        answer = raw_request(port, put_head(f"/v1/model?worker_id={rank1}&step=0", 2**30), b"xxxx")
        assert answer.startswith(b"HTTP/1.1 403"), answer
        answer = raw_request(port, put_head(f"/v1/checkpoint?worker_id=intruder&round_id={job.round_id}&step=1", 2**30))
        assert answer.startswith(b"HTTP/1.1 403"), answer
        # rank 0 itself, beyond what the master takes
        answer = raw_request(port, put_head(f"/v1/checkpoint?worker_id={rank0}&round_id={job.round_id}&step=1", MAX_STATE_BYTES + 1))
        assert answer.startswith(b"HTTP/1.1 413"), answer
        # a JSON request beyond its cap
        head = (f"POST /v1/heartbeat HTTP/1.1\r\nHost: master\r\nAuthorization: Bearer {TOKEN}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {MAX_JSON_BYTES + 1}\r\n")
        assert raw_request(port, head, b'{"worker_id":').startswith(b"HTTP/1.1 413")
        # within the caps, rank 0's checkpoint is taken
        assert httpx.put(f"http://127.0.0.1:{port}/v1/checkpoint", headers=AUTH, content=b"state",
                         params={"worker_id": rank0, "round_id": job.round_id, "step": 1}).status_code == 200
    assert job.state.checkpoints.enabled and job.state.state == "running"


def test_a_connection_that_asks_nothing_is_closed_and_one_address_cannot_take_the_server(monkeypatch):
    job = Job()
    share = per_peer_limit(3)  # what one address may hold for this 3-worker job
    monkeypatch.setitem(SERVER_LIMITS, "limit_concurrency", share + 10)
    with served(job) as port:
        # 127.0.0.2 is this machine too (all of 127/8 is loopback): another host, as the server sees it.
        # It opens more connections than the server's whole limit, and sends nothing on them.
        held = [socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.2", 0)) for _ in range(share + 20)]
        try:
            started = time.monotonic()
            assert httpx.get(f"http://127.0.0.1:{port}/v1/status", headers=AUTH).status_code == 200
            closed_after = []
            for s in held:
                s.settimeout(REQUEST_DEADLINE_S + 5)
                try:
                    assert s.recv(1) == b""
                except ConnectionResetError:
                    pass
                closed_after.append(time.monotonic() - started)
        finally:
            for s in held:
                s.close()
    # every one closed by the server: those beyond the address's share at once, the rest in time
    assert max(closed_after) < REQUEST_DEADLINE_S + 3, max(closed_after)


def test_a_master_whose_api_cannot_serve_fails_at_once_naming_why(caplog):
    """Not a job that writes master.json naming an address nobody answers, and whose workers
    then fail one by one: the API's own error, on the master's thread, exit 1 (run it again)."""
    import socket

    from fastapi import FastAPI

    from elastic_step.errors import JobFailed
    from elastic_step.master.startup import ApiServer

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.close()  # as a socket lost between its bind and the server's start
    started = time.monotonic()
    with pytest.raises(JobFailed, match=r"^the master's API ended before it served \(OSError: .*Bad file descriptor\)"):
        ApiServer(FastAPI(), listener).start()
    assert time.monotonic() - started < 10
    # in the master's log too: an API that stops later, while the job runs, is said there
    assert any(r.getMessage().startswith("the master's API stopped: OSError") for r in caplog.records)
