"""A `--mode ps` job's shard pods as addresses under one routing table (what ps/local.py's
LocalShards is for processes), and asking them: one request (`asked`), a shard's rows a message's
worth at a time (`exported`), its last snapshot's file (`fetch_snapshot`), a scale --ps
(`PodShards.resize`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elastic_step.ps import wire
from elastic_step.ps.api import PsError, Status
from elastic_step.ps.client import PsClient
from elastic_step.ps.moves import MoveReport, export_parts, move, stats_sum
from elastic_step.ps.routing import RoutingTable

if TYPE_CHECKING:
    from elastic_step.backends.kubernetes.ps_pods import PsPods


@dataclass
class PodShard:
    shard: int
    host: str  # the pod's IP
    port: int

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"


class PodShards:
    """The shards' addresses under one routing table (what LocalShards is for processes)."""

    def __init__(self, shards: list[PodShard], routing: RoutingTable, launcher: PsPods | None = None):
        self.shards, self.routing, self.launcher = shards, routing, launcher

    def routes(self) -> RoutingTable:
        return RoutingTable(self.routing.epoch, self.routing.owners, [s.endpoint for s in self.shards])

    def resize(self, shards: int, call) -> MoveReport:
        """`scale --ps`: run `shards` shard pods from now on, moving only the virtual shards that
        change owner (ps/moves.py) while the workers go on, as LocalShards.resize does with
        processes. Added pods start empty under the current routing; removed ones (the highest
        indices) leave the list once they gave everything away, then their pods are deleted.
        `call(endpoint, header, *arrays)` asks one shard."""
        added = self.launcher.add_shards(range(len(self.shards), shards), self.routing)
        everyone = self.shards + added
        resized = self.routing.resized(shards, [s.endpoint for s in everyone[:shards]])
        try:
            report = move(lambda i, *request: call(everyone[i].endpoint, *request), self.routing, resized)
        except BaseException:
            self.shards = everyone  # deleted with the others at the end (a resume from a cut needs no move)
            raise
        self.routing = resized
        self.shards = everyone[:shards]
        self.launcher.delete_shards([s.shard for s in everyone[shards:]])
        return report


def asked(client: PsClient, shard: PodShard, request: dict) -> dict:
    """One shard's OK answer to `request`; PsError saying why not."""
    try:
        header, _ = client.call(shard.endpoint, request)
    except (OSError, ValueError) as exc:
        raise PsError(f"shard {shard.shard} at {shard.endpoint} did not answer its {request['op']} ({exc})") from None
    if header.get("status") != Status.OK:
        raise PsError(f"shard {shard.shard} refused its {request['op']}: {header.get('detail') or header.get('status')}")
    return header


def exported(client: PsClient, shard: PodShard, vshards: list[int]):
    """The rows of a shard's virtual shards, a message's worth at a time (moves.export_parts):
    one message of a table of several GiB would be over what a frame may carry."""
    held = stats_sum(asked(client, shard, {"op": "stats"}), "bytes")
    for part in export_parts(vshards, held, len(vshards)):
        reply, body = client.call(shard.endpoint, {"op": "export", "vshards": part})
        yield wire.unpack(reply["arrays"], body)


def fetch_snapshot(client: PsClient, shard: PodShard, target: str) -> None:
    """A snapshot the shard takes now (every update it acknowledged), copied from its pod's folder
    to `target` in parts (a frame's body is bounded); PsError saying why not."""
    asked(client, shard, {"op": "snapshot"})
    offset, size, first = 0, 1, None
    with open(target + ".partial", "wb") as out:
        while offset < size:
            header, body = client.call(shard.endpoint, {"op": "snapshot_file", "offset": offset})
            if header.get("status") != Status.OK:
                raise PsError(f"shard {shard.shard} did not give its snapshot: {header.get('detail') or header.get('status')}")
            size, first = int(header["size"]), first or header["file"]
            if header["file"] != first or (not body and offset < size):  # replaced, or cut short, mid-copy
                raise PsError(f"shard {shard.shard}'s snapshot changed or ended at {offset} of {size} bytes while it was copied")
            out.write(body)
            offset += len(body)
    os.replace(target + ".partial", target)
