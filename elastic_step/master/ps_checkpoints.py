"""A `--mode ps` job's checkpoints: one cut across every shard, and a resume from exactly it.

A checkpoint of step S holds rank 0's dense weights of step S and the dispatcher's rows applied
through step S (pairing.py). For a PS job it holds a third part, under the ledger's `ps_cut`: the
step, the routing, and the SHA-256 of each shard's cut of S (ps/cuts.py: the tables holding
exactly the pushes of steps <= S). The master asks every shard for its cut before the checkpoint
is recorded; a shard that cannot give one (down, moved past S without a cut, a scale --ps across
S) fails that checkpoint in one line, and the job goes on to its next one.

A resume from that checkpoint puts every shard folder back to its cut (its snapshot becomes the
cut, its ledger goes) before any shard starts, so the tables, the dense weights and the rows to
train again are of the same step: the minibatches trained after S are trained, and pushed and
applied, again, once each. A cut that is missing or is not the recorded one (its digest) stops
the resume in one line rather than training on tables of another step.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable

from elastic_step.errors import ConfigError
from elastic_step.ps import cuts
from elastic_step.ps.api import Status
from elastic_step.ps.client import PsClient
from elastic_step.ps.shard import READY_FILE
from elastic_step.ps.state import LEDGER_FILE, ROUTING_FILE, SNAPSHOT_FILE

log = logging.getLogger("elastic_step.master")

ORPHAN_WAIT_S = 120.0  # a SIGKILLed master's shards take their last snapshot before they exit
PS_CUT = "ps_cut"  # the key of a checkpoint's ledger that holds its shards' cut
CUT_TIMEOUT_S = 120.0  # a cut written on request: a snapshot of the shard's tables

# (step, epoch, state, ledger): the recorder's on_checkpoint; False when it did not record it
Record = Callable[[int, int, bytes, dict], bool | None]


class CutFailed(RuntimeError):
    """Some shard could not give its cut of the step: the checkpoint is not taken."""


def cut_shards(addresses: list[str], token: str, step: int, keep: list[int] = ()) -> dict:
    """Every shard's cut of `step`: {"step", "routing", "digests"}; CutFailed in one line."""
    client = PsClient(token, lambda: None, timeout_s=CUT_TIMEOUT_S)
    metas = []
    try:
        for i, address in enumerate(addresses):
            try:
                header, _ = client.call(address, {"op": "cut", "step": step, "keep": list(keep)})
            except (OSError, ValueError) as exc:
                raise CutFailed(f"shard {i} at {address} did not answer ({exc})") from exc
            if header.get("status") != Status.OK:
                raise CutFailed(header.get("detail") or f"shard {i} answered {header.get('status')}")
            metas.append(header)
    finally:
        client.close()
    routing = metas[0]["routing"]
    same = all((m["routing"]["epoch"], m["routing"]["owners"]) == (routing["epoch"], routing["owners"]) for m in metas)
    if not same or max(routing["owners"]) + 1 != len(metas):
        raise CutFailed(f"the shards' cuts of step {step} are of different routings (a scale --ps ran across it)")
    return {"step": step, "routing": {"epoch": routing["epoch"], "owners": routing["owners"], "endpoints": []},
            "digests": [m["digest"] for m in metas]}


class PsCheckpoints:
    """The recorder's on_checkpoint, for a PS job: the shards' cut first, then the record with it.
    `committed()`: the checkpoints a resume may load (the run's committed ones; those handed to
    `record` are uploaded later): the shards keep their cuts, and those newer, and drop the rest."""

    def __init__(self, monitor, record: Record, committed: Callable[[], list[int]] = list):
        self.monitor, self.record, self.committed = monitor, record, committed

    def __call__(self, step: int, epoch: int, state: bytes, ledger: dict) -> bool:
        """Whether the checkpoint was recorded: False when a shard had no cut of `step` (or `record`
        returned False), so that the master records no CHECKPOINT event for it and a stop waiting
        on it asks for the next one (state.py) rather than ending on an older cut as if it were
        this one."""
        if self.monitor.rolling_back.is_set():  # at once: the master's writes wait on this one
            log.warning("checkpoint of step %d not taken: the parameter-server shards are going back to an earlier one", step)
            return False
        try:
            with self.monitor.scaling:  # not while a scale --ps moves rows: its cuts would straddle routings
                cut = cut_shards(list(self.monitor.addresses), self.monitor.client.token, step, self.committed())
        except CutFailed as exc:
            log.warning("checkpoint of step %d not taken: the parameter-server shards have no cut of it: %s", step, exc)
            return False
        ledger[PS_CUT] = cut  # in the handed checkpoint's own ledger: the restore point made of it has its cut (ps_rollback.py)
        return self.record(step, epoch, state, ledger) is not False  # a record may refuse it too


def checkpointing(monitor, record: Record | None, committed: Callable[[], list[int]] = list) -> Record | None:
    """What the master calls with each checkpoint: `record` itself unless the job has shards."""
    if monitor is None or record is None:
        return record
    return PsCheckpoints(monitor, record, committed)


def resumed_cut(ledger: dict | None) -> dict | None:
    """The shards' cut a resumed checkpoint recorded (None: not a PS checkpoint, or an older one)."""
    return (ledger or {}).get(PS_CUT)


def restore_cut(root: str, cut: dict) -> None:
    """Before any shard starts: every shard folder under `root` starts from its cut of the
    checkpoint's step, and folders of shards beyond the cut's count go. ConfigError (one line)
    when a cut is missing or is not the recorded one."""
    count = len(cut["digests"])
    for index, digest in enumerate(cut["digests"]):
        directory = os.path.join(root, f"shard-{index}")
        _wait_for_the_last_shard(directory)
        try:
            cuts.restore(directory, int(cut["step"]), digest, SNAPSHOT_FILE, LEDGER_FILE, ROUTING_FILE)
        except (cuts.CutMissing, OSError) as exc:
            raise ConfigError(f"train --resume: the checkpoint of step {cut['step']} needs parameter-server shard {index}'s "
                              f"cut, but {exc}; resume from the folder the job ran in, or start over without --resume") from exc
    for name in os.listdir(root):
        if name.startswith("shard-") and name[6:].isdigit() and int(name[6:]) >= count:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    log.info("parameter servers: %d shards start from their cuts of step %d", count, cut["step"])


def _wait_for_the_last_shard(directory: str) -> None:
    """After a master SIGKILL its shards stop on their own with a last snapshot (shard.py): wait
    until the folder's last shard process is gone, so that snapshot cannot land over the cut."""
    try:
        with open(os.path.join(directory, READY_FILE), encoding="utf-8") as f:
            pid = int(json.load(f)["pid"])
    except (OSError, ValueError, KeyError):
        return
    deadline = time.monotonic() + ORPHAN_WAIT_S
    while _is_shard(pid) and time.monotonic() < deadline:
        time.sleep(0.1)


def _is_shard(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"elastic_step.ps.shard" in f.read()
    except OSError:  # gone (or no /proc: nothing to wait on)
        return False
