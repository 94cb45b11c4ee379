"""The master's HTTP+JSON API (FastAPI). Every route needs the job's bearer token; a request
without it gets 401 before its body is even parsed, so it cannot change any state. Malformed
bodies get FastAPI's 422. Only live workers of this job may change anything (403 otherwise: a
stale worker of an earlier attempt holds the same token), and a request that does not fit the
job's state now gets 409. Every status code a route returns is declared in the OpenAPI document,
which is generated from the protocol models: the document is the contract the master enforces."""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import Annotated

import uvicorn
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response

from elastic_step.master.connections import guarded_protocol, per_peer_limit
from elastic_step.master.state import MasterState, Refused
from elastic_step.master.ui_page import PAGE, PAGE_HEADERS
from elastic_step.protocol import (
    API,
    MAX_INT,
    READ_ONLY_ROUTES,
    UI_PAGE,
    CollectiveFailedRequest,
    Empty,
    ErrorReply,
    FailJobRequest,
    HeartbeatReply,
    HeartbeatRequest,
    JobSpec,
    PsScaleRequest,
    RegisterRequest,
    Rendezvous,
    RendezvousReply,
    RendezvousRequest,
    RoundId,
    Route,
    ScaleRequest,
    StepsReply,
    StepsRequest,
    TaskFailedRequest,
    TaskReply,
    TaskRequest,
    WorkerId,
)
from elastic_step.terminal import printable

LONG_POLL_S = 1.0
PAGE_REFRESH_S = 2.0  # how often the live page asks (ui_page.py's REFRESH_MS)

# uvicorn's limits for the API server: more concurrent connections than this get 503 (which
# workers retry) instead of exhausting the master's file descriptors, a connection backlog
# beyond the kernel default, and idle keep-alive connections closed after a while. A worker
# holds up to five connections at once (main loop, task prefetch, heartbeat, step reports,
# checkpoint upload), so 512 serves a hundred workers and the operator's CLI. Connections that
# ask nothing, and more than a job's worth from one address, are closed (connections.py).
SERVER_LIMITS = {"limit_concurrency": 512, "backlog": 256, "timeout_keep_alive": 30}

# Request bodies: a JSON request (the largest is a rendezvous with a long list of unacknowledged
# steps) and an uploaded model or checkpoint state. A larger one is answered 413 unread.
MAX_JSON_BYTES = 64 * 2**20
MAX_STATE_BYTES = 8 * 2**30


def server_config(app: FastAPI) -> uvicorn.Config:
    """How the master serves its API: quiet, no lifespan events, within SERVER_LIMITS, with
    connections guarded (connections.py) for as many workers as the app's job may have."""
    per_peer = getattr(app.state, "per_peer_connections", per_peer_limit(1))
    return uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                          http=guarded_protocol(per_peer), **SERVER_LIMITS)


class RequireToken:
    """A plain ASGI middleware (no response streaming, unlike @app.middleware): it answers 401
    before the route, and so before the body is parsed or any state is touched. The read-only
    (view) token, where the job has one, opens the read-only routes and nothing else; the live
    page itself is open, since it holds no data (its script asks the read-only routes, with the
    token from its address's fragment)."""

    def __init__(self, app, token: str, view_token: str | None = None):
        self.app = app
        self.expected = f"Bearer {token}".encode()
        self.viewer = f"Bearer {view_token}".encode() if view_token else None
        self.read_only = {(API + route).encode() for route in READ_ONLY_ROUTES}
        self.denied = JSONResponse({"detail": "missing or wrong bearer token; read it from the job's token file"}, status_code=401)

    def _allowed(self, scope) -> bool:
        path = scope.get("path", "")
        if scope.get("method") == "GET" and path == UI_PAGE:
            return True
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return True
        return (self.viewer is not None and scope.get("method") == "GET" and path.encode() in self.read_only
                and hmac.compare_digest(given, self.viewer))

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and not self._allowed(scope):
            await self.denied(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _declared(*codes: int) -> dict:
    """OpenAPI entries for the refusals a route can answer with (401 on every route)."""
    meaning = {
        400: "the body is not readable as JSON",
        401: "missing or wrong bearer token",
        403: "the caller is not a live worker of this job, or not the member this request needs",
        404: "there is nothing to return",
        409: "the request does not fit the job's state now (the detail says what to do)",
        413: "the body is larger than the master takes",
    }
    return {code: {"model": ErrorReply, "description": meaning[code]} for code in (401, *codes)}


WorkerParam = Annotated[WorkerId, Query()]
StepParam = Annotated[int, Query(ge=0, le=MAX_INT)]
RoundParam = Annotated[RoundId, Query()]
BINARY_BODY = {"requestBody": {"required": True, "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}


def create_app(state: MasterState, token: str, view_token: str | None = None) -> FastAPI:
    app = FastAPI(title="elastic-step master", docs_url=None, redoc_url=None, max_body_size=MAX_JSON_BYTES)
    app.add_middleware(RequireToken, token=token, view_token=view_token)
    app.state.per_peer_connections = per_peer_limit(state.max_workers + state.membership.spares)

    def openapi() -> dict:
        """The generated document, saying also that every route needs the job's bearer token."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {})["securitySchemes"] = {"jobToken": {"type": "http", "scheme": "bearer"}}
            schema["security"] = [{"jobToken": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Refused):
        return JSONResponse({"detail": str(exc)}, status_code=exc.status)

    @app.post(API + Route.REGISTER, response_model=JobSpec, responses=_declared(400, 409))
    async def register(body: RegisterRequest):
        return state.register(body.worker_id, body.pid, body.host, body.engine)

    # Heartbeat and rendezvous answer a stale or unknown worker 200 with "stop": that is how it
    # learns to leave, and it changes nothing.
    @app.post(API + Route.HEARTBEAT, response_model=HeartbeatReply, responses=_declared(400))
    async def heartbeat(body: HeartbeatRequest):
        return state.heartbeat(body.worker_id, body.step, body.resources, body.round_id)

    @app.post(API + Route.RENDEZVOUS, response_model=RendezvousReply, responses=_declared(400))
    async def rendezvous(body: RendezvousRequest):
        deadline = time.monotonic() + LONG_POLL_S
        while True:
            reply = state.rendezvous(body.worker_id, body.step, body.unacked, body.left_round)
            if reply.status != Rendezvous.WAIT or time.monotonic() > deadline:
                return reply
            await asyncio.sleep(0.005)

    @app.post(API + Route.TASK, response_model=TaskReply, responses=_declared(400))
    async def task(body: TaskRequest):
        return state.next_task(body.worker_id, body.round_id)

    @app.post(API + Route.TASK_FAILED, response_model=Empty, responses=_declared(400, 403))
    async def task_failed(body: TaskFailedRequest):
        state.task_failed(body.worker_id, body.task_id, printable(body.error))
        return Empty()

    @app.post(API + Route.STEPS, response_model=StepsReply, responses=_declared(400, 403, 409))
    async def steps(body: StepsRequest):
        acked = state.report_steps(body.worker_id, body.round_id, body.steps)
        return StepsReply(acked_step=acked, epoch=state.dispatcher.current_epoch, checkpoint_now=state.checkpoint_now)

    @app.post(API + Route.COLLECTIVE_FAILED, response_model=Empty, responses=_declared(400, 403))
    async def collective_failed(body: CollectiveFailedRequest):
        state.collective_failed(body.worker_id, body.round_id, printable(body.error))
        return Empty()

    @app.post(API + Route.FAIL, response_model=Empty, responses=_declared(400, 403))
    async def fail(body: FailJobRequest):
        state.fail_by_worker(body.worker_id, printable(body.reason))
        return Empty()

    @app.post(API + Route.PREFLIGHT_FAILED, response_model=Empty, responses=_declared(400, 403, 409))
    async def preflight_failed(body: FailJobRequest):
        state.preflight_failed(body.worker_id, printable(body.reason))
        return Empty()

    # An upload's body is read only once the caller is known to be the round's rank 0.
    @app.put(API + Route.MODEL, response_model=Empty, responses=_declared(403, 409, 413), openapi_extra=BINARY_BODY,
             max_body_size=MAX_STATE_BYTES)
    async def upload_model(request: Request, worker_id: WorkerParam, step: StepParam):
        state.may_upload(worker_id)
        data = await request.body()
        if not state.upload_model(worker_id, step, data):
            raise HTTPException(409, "the job is not finished at that step")
        return Empty()

    @app.put(API + Route.CHECKPOINT, response_model=Empty, responses=_declared(403, 409, 413), openapi_extra=BINARY_BODY,
             max_body_size=MAX_STATE_BYTES)
    async def checkpoint(request: Request, worker_id: WorkerParam, round_id: RoundParam, step: StepParam):
        state.may_upload(worker_id, round_id)
        state.checkpoint_state(worker_id, round_id, step, await request.body())
        return Empty()

    @app.get(
        API + Route.INITIAL_STATE,
        responses={**_declared(404), 200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}},
        response_class=Response,
    )
    async def initial_state():
        if state.initial_state is None:
            raise HTTPException(404, "this job has no initial state")
        return Response(state.initial_state.data, media_type="application/octet-stream")

    @app.post(API + Route.SCALE, responses=_declared(400, 409))
    async def scale(body: ScaleRequest):
        try:
            state.scale(body.workers)
        except ValueError as exc:  # outside the job's range, or the job has ended
            raise HTTPException(409, str(exc)) from exc
        return state.status()

    @app.post(API + Route.SCALE_PS, responses=_declared(400, 409))
    async def scale_ps(body: PsScaleRequest):
        if state.ps_shards is None:
            raise HTTPException(409, "this job has no parameter-server shards: scale --ps is for a --mode ps job")
        try:  # moves rows between shards for a while: off the event loop (master/ps_monitor.py)
            moved = await asyncio.to_thread(state.ps_shards.scale, body.shards)
        except ValueError as exc:  # the same count, a shard down, another scale under way, the job ended
            raise HTTPException(409, str(exc)) from exc
        return {**state.status(), "ps_scale": moved}

    @app.get(API + Route.STATUS, responses=_declared())
    async def status():
        return state.status()

    # Read-only, and off the master's lock: each log has its own.
    @app.get(API + Route.EVENTS, responses=_declared())
    async def events(request: Request, since: Annotated[int, Query(ge=0, le=MAX_INT)] = 0):
        unknown = set(request.query_params) - {"since"}
        if unknown:  # strict, as the bodies are: a parameter the route does not name is an error
            raise RequestValidationError([{"type": "extra_forbidden", "loc": ("query", sorted(unknown)[0]),
                                           "msg": "Extra inputs are not permitted", "input": None}])
        found, next_index = state.events.since(since)
        return {"events": found, "next": next_index}

    app.state.last_page_poll = None  # when a live page last asked (only the page asks for the history)

    @app.get(API + Route.HISTORY, responses=_declared())
    async def history():
        app.state.last_page_poll = time.monotonic()
        return {"steps": state.step_log.history() if state.step_log is not None else []}

    @app.post(API + Route.STOP, responses=_declared(409))
    async def stop():
        try:
            return state.request_stop()
        except ValueError as exc:  # the job has ended, or it takes no checkpoints
            raise HTTPException(409, str(exc)) from exc

    @app.get(UI_PAGE, response_class=HTMLResponse, include_in_schema=False)
    async def page():
        return HTMLResponse(PAGE, headers=PAGE_HEADERS)

    return app
