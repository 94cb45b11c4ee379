"""The master's HTTP+JSON API (FastAPI). Every route needs the job's bearer token; a request
without it gets 401 before its body is even parsed, so it cannot change any state. Malformed
bodies get FastAPI's 422."""

from __future__ import annotations

import asyncio
import hmac
import time

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response

from elastic_step.master.state import MasterState
from elastic_step.protocol import (
    API,
    CollectiveFailedRequest,
    FailJobRequest,
    HeartbeatReply,
    HeartbeatRequest,
    JobSpec,
    RegisterRequest,
    RendezvousReply,
    RendezvousRequest,
    ScaleRequest,
    StepsReply,
    StepsRequest,
    TaskFailedRequest,
    TaskReply,
    TaskRequest,
)

LONG_POLL_S = 1.0


class RequireToken:
    """A plain ASGI middleware (no response streaming, unlike @app.middleware): it answers 401
    before the route, and so before the body is parsed or any state is touched."""

    def __init__(self, app, token: str):
        self.app = app
        self.expected = f"Bearer {token}".encode()
        self.denied = JSONResponse({"detail": "missing or wrong bearer token; read it from the job's token file"}, status_code=401)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await self.denied(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(state: MasterState, token: str) -> FastAPI:
    app = FastAPI(title="elastic-step master", docs_url=None, redoc_url=None)
    app.add_middleware(RequireToken, token=token)

    @app.post(f"{API}/register", response_model=JobSpec)
    async def register(body: RegisterRequest):
        spec = state.register(body.worker_id, body.pid, body.host)
        if spec is None:
            raise HTTPException(409, f"worker {body.worker_id!r} was not launched by this master or is gone")
        return spec

    @app.post(f"{API}/heartbeat", response_model=HeartbeatReply)
    async def heartbeat(body: HeartbeatRequest):
        return state.heartbeat(body.worker_id, body.step)

    @app.post(f"{API}/rendezvous", response_model=RendezvousReply)
    async def rendezvous(body: RendezvousRequest):
        deadline = time.monotonic() + LONG_POLL_S
        while True:
            reply = state.rendezvous(body.worker_id, body.step, body.unacked, body.left_round)
            if reply.status != "wait" or time.monotonic() > deadline:
                return reply
            await asyncio.sleep(0.005)

    @app.post(f"{API}/task", response_model=TaskReply)
    async def task(body: TaskRequest):
        return state.next_task(body.worker_id, body.round_id)

    @app.post(f"{API}/task-failed")
    async def task_failed(body: TaskFailedRequest):
        state.task_failed(body.worker_id, body.task_id, body.error)
        return {}

    @app.post(f"{API}/steps", response_model=StepsReply)
    async def steps(body: StepsRequest):
        try:
            acked = state.report_steps(body.worker_id, body.round_id, body.steps)
            return StepsReply(acked_step=acked, epoch=state.dispatcher.current_epoch)
        except ValueError as exc:  # a gap or a range that does not fit: the reporter retries
            raise HTTPException(409, str(exc)) from exc

    @app.post(f"{API}/collective-failed")
    async def collective_failed(body: CollectiveFailedRequest):
        state.collective_failed(body.worker_id, body.round_id, body.error)
        return {}

    @app.post(f"{API}/fail")
    async def fail(body: FailJobRequest):
        state.fail(f"{body.worker_id}: {body.reason}")
        return {}

    @app.put(f"{API}/model")
    async def upload_model(request: Request, worker_id: str, step: int):
        data = await request.body()
        if not state.upload_model(worker_id, step, data):
            raise HTTPException(409, "the job is not finished at that step")
        return {}

    @app.put(f"{API}/checkpoint")
    async def checkpoint(request: Request, worker_id: str, step: int):
        state.checkpoint_state(worker_id, step, await request.body())
        return {}

    @app.get(f"{API}/initial-state")
    async def initial_state():
        if state.initial_state is None:
            raise HTTPException(404, "this job has no initial state")
        return Response(state.initial_state.data, media_type="application/octet-stream")

    @app.post(f"{API}/scale")
    async def scale(body: ScaleRequest):
        try:
            state.scale(body.workers)
        except ValueError as exc:
            raise HTTPException(422, str(exc)) from exc
        return state.status()

    @app.get(f"{API}/status")
    async def status():
        return state.status()

    return app
