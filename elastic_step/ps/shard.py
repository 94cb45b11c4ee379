"""A parameter-server shard process: ShardState behind the binary protocol of wire.py.

    python -m elastic_step.ps.shard --dir DIR --shard I --host 127.0.0.1 --port 0 --token-file F

DIR holds `config.json` ({"tables": [TableSpec...], "routing": RoutingTable, "snapshot_every":
n, "checkpoint_every": K}), and the shard's snapshot, ledger, routing and checkpoint cuts. The shard recovers first (snapshot, then the
ledger's tail) and only then listens and writes `ready.json` (host, port, pid, epoch, replayed,
load_s, replay_s): whoever launched it waits for that file. The token comes from a file, never
the command line; every request carries it and one without it is refused. SIGTERM takes a last
snapshot and exits, and so does the loss of the process that launched it (a master SIGKILLed).

Requests (header `op`): pull, push, routing, stats, digest, counters, snapshot (wire.py) and its
file (`snapshot_file`, in parts), a checkpoint's cut (cuts.py) and its files (`cut_file`, in parts), a rollback to a checkpoint's cut
behind a fence of rounds (state.py), and a move's adopt, export, import and release (state.py,
moves.py). A refusal for a stale epoch carries the shard's routing, so a client learns the next
one from any shard it reaches.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import json
import os
import signal
import socket
import socketserver
import sys
import threading
import time

import numpy as np

from elastic_step.allocator import keep_step_memory
from elastic_step.exit_codes import ExitCode
from elastic_step.ps import cuts, wire
from elastic_step.ps.api import Status, TableSpec
from elastic_step.ps.ledger import LedgerFailed, LedgerRecord
from elastic_step.ps.routing import RoutingTable
from elastic_step.ps.state import SNAPSHOT_FILE, Refused, ShardClosed, ShardState

READY_FILE = "ready.json"
PARENT_POLL_S = 1.0
CONFIG_FILE = "config.json"
MOVE_OPS = frozenset({"adopt", "export", "import", "release"})
FILE_OPS = frozenset({"cut_file", "snapshot_file"})  # a file read in parts, from a byte offset


class ShardHandler(socketserver.BaseRequestHandler):
    """One client connection: requests answered in order until the client closes."""

    def handle(self) -> None:
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            try:
                header, body = wire.receive(self.request)
            except (ConnectionError, wire.FrameError, ValueError, OSError):
                return
            if not wire.authorized(self.request, header, self.server.token):
                return
            if self.server.stopping.is_set():  # no answer: the client asks again, elsewhere or later
                return
            try:
                reply, arrays = self.server.answer(header, body)
            except ShardClosed:
                return
            except LedgerFailed as exc:  # nothing this process holds can be acknowledged any more
                stop_on_failed_ledger(self.server.state, exc)
            except (KeyError, TypeError, ValueError) as exc:  # a malformed request, not a crash
                reply, arrays = {"status": Status.BAD_REQUEST, "detail": str(exc)[:200]}, ()
            wire.send(self.request, reply, *arrays)


def stop_on_failed_ledger(state: ShardState, exc: LedgerFailed) -> None:
    """Leave the relaunch its note (state.py, LEDGER_FAILED_FILE) and stop at once: no other
    request may be answered, nor a snapshot written over what the disk may not hold."""
    state.note_failed_ledger()
    print(f"elastic_step.ps.shard: {exc}; stopping; the relaunched shard recovers and writes a snapshot "
          "(check the volume: `dmesg` shows its I/O errors)", file=sys.stderr, flush=True)
    os._exit(ExitCode.FAILED)


class ShardServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    # socketserver's listen backlog is 5: after a relaunch every worker and the master connect
    # again at once, and a dropped SYN costs a connection a retransmit (the clients give up on a
    # connection after 3.5 s, ps/client.py).
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], state: ShardState, token: str):
        self.state = state
        self.token = token.encode()
        self.stopping = threading.Event()  # SIGTERM: connections get no more answers
        super().__init__(address, ShardHandler)

    def answer(self, header: dict, body: bytearray) -> tuple[dict, tuple]:
        op, state = header["op"], self.state
        if op == "stats":
            return {"status": Status.OK, **state.stats()}, ()
        if op == "routing":  # with a routing: take it as it is; without: say which is current
            if "routing" in header:
                state.set_routing(RoutingTable.from_json(header["routing"]))
            return {"status": Status.OK, "epoch": state.routing.epoch, "routing": state.routing.to_json()}, ()
        if op == "snapshot":
            state.snapshot()
            return {"status": Status.OK}, ()
        if op == "cut":
            try:
                return {"status": Status.OK, **state.cut(int(header["step"]), list(header.get("keep", [])))}, ()
            except cuts.CutMissing as exc:
                return {"status": Status.NO_CUT, "detail": str(exc)}, ()
        if op == "rollback":  # the job goes back to a checkpoint: fence the rounds before, hold its cut again
            try:
                replayed = state.rollback(int(header["step"]), str(header["digest"]), int(header["fence"]))
            except cuts.CutMissing as exc:
                return {"status": Status.NO_CUT, "detail": str(exc)}, ()
            return {"status": Status.OK, "replayed": replayed, "epoch": state.routing.epoch}, ()
        if op in FILE_OPS and int(header["offset"]) < 0:
            return {"status": Status.BAD_REQUEST, "detail": f"offset {header['offset']}: give a byte offset of 0 or more"}, ()
        if op == "cut_file":  # a sealed cut's bytes, for a master that keeps it where this folder is not (a pod's)
            try:
                return _cut_file(state.directory, int(header["step"]), header["part"], int(header["offset"]))
            except cuts.CutMissing as exc:
                return {"status": Status.NO_CUT, "detail": str(exc)}, ()
        if op == "snapshot_file":  # the last snapshot's bytes, for a master whose shards' folders are not its own (pods)
            return _snapshot_file(state.directory, int(header["offset"]))
        if op in MOVE_OPS:
            return self._move(op, header, body)
        table = state.tables[header["table"]]
        if op == "digest":
            with state.lock:
                return {"status": Status.OK, "digest": table.digest()}, ()
        if op == "counters":
            with state.lock:
                held = table.arrays()
                return {"status": Status.OK, "count": len(held["ids"])}, (held["ids"].copy(), held["updates"].copy())
        count = int(header["count"])
        ids, grads = wire.ids_and_rows(body, count, table.spec.dim)
        try:  # the epoch and owner are checked under the shard's lock, where a move begins too
            if op == "pull":
                return {"status": Status.OK}, (state.pull(header["table"], ids, int(header["epoch"])),)
            if op == "push":
                return self._push(header, ids, grads)
        except Refused as refused:
            return {"status": refused.status, "epoch": state.routing.epoch, "routing": state.routing.to_json()}, ()
        raise ValueError(f"unknown op {op!r}")

    def _move(self, op: str, header: dict, body: bytearray) -> tuple[dict, tuple]:
        state = self.state
        if op == "adopt":
            state.adopt(RoutingTable.from_json(header["routing"]))
            return {"status": Status.OK, "epoch": state.routing.epoch}, ()
        if op == "export":
            spec, arrays = wire.pack(state.export([int(v) for v in header["vshards"]]))
            return {"status": Status.OK, "arrays": spec}, arrays
        if op == "import":
            arrays = wire.unpack(header["arrays"], body)
            installed = state.install(RoutingTable.from_json(header["routing"]), [int(v) for v in header["vshards"]], arrays)
            return {"status": Status.OK, "rows": installed}, ()
        return {"status": Status.OK, "rows": state.release()}, ()  # release

    def _push(self, header: dict, ids: np.ndarray, grads: np.ndarray | None) -> tuple[dict, tuple]:
        if grads is None or not np.isfinite(grads).all():
            raise ValueError("a push needs finite gradients, one row per id")
        if self.state.tables[header["table"]].outside(ids) is not None:  # refused before the ledger holds it
            raise ValueError(f"a push to table {header['table']!r} with ids outside its declared rows")
        record = LedgerRecord(header["table"], int(header["task"]), int(header["batch_seq"]), int(header["attempt"]), ids, grads)
        step = int(header["step"]) if header.get("step") is not None else None  # a checkpoint's cut may be due first
        return {"status": Status.OK, "applied": self.state.push(record, int(header["epoch"]), step)}, ()


def _cut_file(directory: str, step: int, part: str, offset: int) -> tuple[dict, tuple]:
    """Up to cuts.FILE_CHUNK bytes of a sealed cut's `part` (one of cuts.PARTS) from `offset`, and
    the file's size. Only a cut whose .json holds its digest: nothing half-written is handed out."""
    found = cuts.meta(directory, step)
    if part not in cuts.PARTS or found is None or found.get("digest") is None:
        raise cuts.CutMissing(f"no sealed cut of step {step} (part {part!r}) in this shard")
    try:
        stat, data = _file_part(cuts.path(directory, step, part), offset)
    except FileNotFoundError:
        if part == "ledger":  # a cut written whole has no ledger records
            return {"status": Status.OK, "size": 0, "offset": offset}, ()
        raise cuts.CutMissing(f"the cut of step {step} was dropped") from None
    return {"status": Status.OK, "size": stat.st_size, "offset": offset}, (np.frombuffer(data, np.uint8),)


def _snapshot_file(directory: str, offset: int) -> tuple[dict, tuple]:
    """Up to cuts.FILE_CHUNK bytes of the folder's snapshot from `offset`, its size, and which
    file it is: a later snapshot replaces the file, and a reader must not mix two of them."""
    try:
        found, data = _file_part(os.path.join(directory, SNAPSHOT_FILE), offset)
    except FileNotFoundError:
        return {"status": Status.BAD_REQUEST, "detail": "no snapshot yet: ask for a `snapshot` first"}, ()
    return ({"status": Status.OK, "size": found.st_size, "file": f"{found.st_ino}.{found.st_mtime_ns}"},
            (np.frombuffer(data, np.uint8),))


def _file_part(path: str, offset: int) -> tuple[os.stat_result, bytes]:
    """Up to cuts.FILE_CHUNK bytes of a file from `offset`, with the stat of the file they came from."""
    with open(path, "rb") as f:
        found = os.fstat(f.fileno())
        f.seek(offset)
        return found, f.read(cuts.FILE_CHUNK)


def _bind_host(host: str) -> str:
    """Only a concrete address: loopback, or the pod's own IP; never every interface."""
    address = ipaddress.ip_address(host)
    if address.is_unspecified:
        raise ValueError(f"--host {host}: give 127.0.0.1 or the pod's own IP, not a wildcard address")
    return host


def _stop_when_orphaned(parent: int, stop) -> None:
    """Stop as on SIGTERM (a last snapshot) once the process that launched this shard is gone,
    its SIGKILL included: no shard is left listening after its master."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    stop(signal.SIGTERM, None)


def _write_ready(directory: str, info: dict) -> None:
    partial = os.path.join(directory, READY_FILE + ".partial")
    with open(partial, "w", encoding="utf-8") as f:
        json.dump(info, f)
    os.replace(partial, os.path.join(directory, READY_FILE))


def load_config(directory: str) -> tuple[list[TableSpec], RoutingTable, int, int]:
    """(tables, routing, snapshot_every, checkpoint_every) from the folder's config.json."""
    with open(os.path.join(directory, CONFIG_FILE), encoding="utf-8") as f:
        config = json.load(f)
    specs = [TableSpec.from_json(t) for t in config["tables"]]
    return (specs, RoutingTable.from_json(config["routing"]), int(config.get("snapshot_every", 1000)),
            int(config.get("checkpoint_every", 0)))


def serve(args: argparse.Namespace) -> None:
    try:
        os.unlink(os.path.join(args.dir, READY_FILE))
    except FileNotFoundError:
        pass
    specs, routing, snapshot_every, checkpoint_every = load_config(args.dir)
    keep_step_memory()
    token = wire.read_token(args.token_file)
    state = ShardState(args.dir, specs, args.shard, routing, snapshot_every, sync=not args.no_fsync, checkpoint_every=checkpoint_every)
    replayed = state.recover()
    server = ShardServer((_bind_host(args.host), args.port), state, token)

    def stop(signum, frame):
        server.stopping.set()
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    threading.Thread(target=_stop_when_orphaned, args=(os.getppid(), stop), name="parent-watch", daemon=True).start()
    host, port = server.server_address[:2]
    _write_ready(args.dir, {"host": host, "port": port, "pid": os.getpid(), "epoch": state.routing.epoch, "replayed": replayed, **state.recovery_s})
    server.serve_forever(poll_interval=0.2)
    server.server_close()
    try:
        state.snapshot()  # SIGTERM is a preemption: leave a snapshot with nothing left to replay
        state.close()  # what a push wrote after the snapshot is synced before its waiter answers
    except LedgerFailed as exc:
        stop_on_failed_ledger(state, exc)


# What a failing volume answers (not a wrong flag): the shard fails, and its relaunch may find the
# volume well again, where a bad --dir or --token-file would fail the same way every time.
VOLUME_ERRORS = frozenset({errno.EIO, errno.ENOSPC, errno.EROFS, errno.EDQUOT})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="elastic_step.ps.shard", description="serve one parameter-server shard")
    parser.add_argument("--dir", required=True, help="the shard's folder: config.json, snapshot, ledger")
    parser.add_argument("--shard", type=int, required=True, help="this shard's index in the routing table")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind: 127.0.0.1 or the pod's IP")
    parser.add_argument("--port", type=int, default=0, help="port to bind (0: any; see ready.json)")
    parser.add_argument("--token-file", required=True, help="file holding the job token")
    parser.add_argument("--no-fsync", action="store_true", help="do not fsync the ledger (benchmarks only: loses updates on a crash)")
    args = parser.parse_args(argv)
    try:
        serve(args)
    except LedgerFailed as exc:  # at the start: the snapshot after a failed fsync's relaunch
        print(f"elastic_step.ps.shard: {exc}; check the volume (`dmesg` shows its I/O errors)", file=sys.stderr)
        return ExitCode.FAILED
    except cuts.CutMissing as exc:  # at the start: finishing a restore a crash cut short
        print(f"elastic_step.ps.shard: cannot finish putting back a checkpoint's cut: {exc}; resume the job from "
              "another checkpoint", file=sys.stderr)
        return ExitCode.FAILED
    except (OSError, ValueError, KeyError) as exc:
        if isinstance(exc, OSError) and exc.errno in VOLUME_ERRORS:
            print(f"elastic_step.ps.shard: the volume of {exc.filename or args.dir} failed: {exc}; check it (`dmesg` shows "
                  "its I/O errors, `df` a full disk)", file=sys.stderr)
            return ExitCode.FAILED
        print(f"elastic_step.ps.shard: {exc}; check --dir, --host and --token-file", file=sys.stderr)
        return ExitCode.BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
