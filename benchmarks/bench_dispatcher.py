"""The master's bookkeeping under load.

1. In process: a job of 1,000,000 tasks — cost per task handed out and applied, early vs late
   (flat means O(1)), and the memory the dispatcher and ledger hold (target <= 100 bytes a task).
2. Over HTTP: task requests and step reports served per second by the real API (FastAPI on
   uvicorn, the master pinned to one core) for 1,000 simulated workers, the load generator on
   the other core (target >= 5,000/s)."""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import resource
import socket
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from common import machine  # noqa: E402

from elastic_step.master.dispatcher import Dispatcher  # noqa: E402
from elastic_step.master.ledger import Consumed, Ledger  # noqa: E402


def million_tasks() -> None:
    tracemalloc.start()
    started = time.perf_counter()
    dispatcher = Dispatcher([1000] * 1000, [f"part-{i:05d}" for i in range(1000)], rows_per_task=1, epochs=1, shuffle=True)
    ledger = Ledger(dispatcher)
    built = time.perf_counter() - started
    _, peak_built = tracemalloc.get_traced_memory()
    chunk, costs = 100_000, []
    step = 0
    for _ in range(10):
        t0 = time.perf_counter()
        for _ in range(chunk):
            task = dispatcher.next_task("w")
            step += 1
            ledger.ingest(step, [Consumed(task.id, 0, task.count)])
        costs.append((time.perf_counter() - t0) / chunk * 1e6)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert dispatcher.finished
    print(f"  1,000,000 tasks: built in {built:.2f}s; hand out + apply per task: first 100k {costs[0]:.2f} us, "
          f"last 100k {costs[-1]:.2f} us (ratio {costs[-1] / costs[0]:.2f}, flat = 1)")
    print(f"  memory (Python heap peak, tracemalloc): {peak_built / 2**20:.1f} MB after building, {peak / 2**20:.1f} MB peak, "
          f"{peak / 1_000_000:.0f} bytes per task (target <= 100); "
          f"process max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


WORKERS = 1000


def serve(port_queue, core: int) -> None:
    os.sched_setaffinity(0, {core})
    import uvicorn

    from elastic_step.master.api import create_app
    from elastic_step.master.events import EventLog
    from elastic_step.master.state import MasterState, Timeouts
    from test_master_state import SPEC, RecordingBackend

    dispatcher = Dispatcher([1000] * 1000, [f"part-{i}" for i in range(1000)], rows_per_task=10, epochs=1)
    state = MasterState(SPEC, dispatcher, Ledger(dispatcher), RecordingBackend(), EventLog(None), 1, WORKERS,
                        timeouts=Timeouts(heartbeat_s=3600, rendezvous_s=3600, startup_grace_s=3600))
    state.launch_all()
    for worker_id in list(state.workers):
        state.register(worker_id, 1, "h")
    state.tick()
    for _ in range(2):
        for member in state.round.members:
            state.rendezvous(member, -1, [], 0)
    assert state.round.ready
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    port_queue.put((sock.getsockname()[1], state.round.id))
    uvicorn.Server(uvicorn.Config(create_app(state, "t"), log_level="error", access_log=False, lifespan="off")).run(sockets=[sock])


def request(path: str, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload


async def read_response(reader) -> dict:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    return json.loads(await reader.readexactly(length))


async def load(port: int, round_id: int, seconds: float, connections: int) -> tuple[int, int]:
    tasks: asyncio.Queue = asyncio.Queue()
    counts = {"task": 0, "steps": 0}
    deadline = time.monotonic() + seconds

    async def asker(index: int):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        i = index
        while time.monotonic() < deadline:
            writer.write(request("/v1/task", {"worker_id": f"w{i % WORKERS}.1", "round_id": round_id}))
            reply = await read_response(reader)
            counts["task"] += 1
            if reply["status"] == "task":
                tasks.put_nowait(reply["task"])
            i += connections
        writer.close()

    async def reporter():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        step = 0
        while time.monotonic() < deadline:
            try:
                task = await asyncio.wait_for(tasks.get(), 0.5)
            except asyncio.TimeoutError:
                continue
            step += 1
            record = {"step": step, "ranges": [{"task_id": task["id"], "offset": 0, "count": task["count"]}],
                      "samples": task["count"], "loss": 1.0, "time": time.time()}
            writer.write(request("/v1/steps", {"worker_id": "w0.1", "round_id": round_id, "steps": [record]}))
            await read_response(reader)
            counts["steps"] += 1
        writer.close()

    await asyncio.gather(reporter(), *(asker(i) for i in range(connections)))
    return counts["task"], counts["steps"]


def http_load(seconds: float) -> None:
    ports: multiprocessing.Queue = multiprocessing.Queue()
    server = multiprocessing.Process(target=serve, args=(ports, 0), daemon=True)
    server.start()
    port, round_id = ports.get(timeout=60)
    time.sleep(0.5)
    if os.cpu_count() > 1:
        os.sched_setaffinity(0, {1})
    started = time.monotonic()
    task_requests, step_reports = asyncio.run(load(port, round_id, seconds, connections=32))
    elapsed = time.monotonic() - started
    server.terminate()
    total = (task_requests + step_reports) / elapsed
    print(f"  HTTP, {WORKERS} simulated workers, master on one core: {total:,.0f} requests/s "
          f"({task_requests / elapsed:,.0f} task requests/s + {step_reports / elapsed:,.0f} step reports/s; target >= 5,000/s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--no-http", action="store_true", help="the in-process million tasks only")
    args = parser.parse_args()
    print(f"dispatcher and API; {machine()}")
    million_tasks()
    if not args.no_http:
        http_load(args.seconds)


if __name__ == "__main__":
    main()
