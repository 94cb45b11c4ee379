"""Checkpoint cuts: a shard's snapshot of exactly the pushes of steps <= S, for a checkpoint of step S.

A checkpoint of a `--mode ps` job is one cut across every shard: the dense weights of step S,
the dispatcher's rows applied through step S, and each shard's tables holding exactly the
pushes trained in steps 1..S. Every push names the step it is trained in (ps_step.py), and a
worker pushes a step's gradients before it joins that step's allreduce, so every push of a step
<= S is acknowledged before any push of a step > S is sent. A shard therefore holds the cut of
S at the moment the first push of a step > S reaches it, and only then.

Why the shards cut themselves, on that first push, rather than the master pausing pushes: rank 0
decides a checkpoint after its step, while the other ranks already push the next one, so a
request from the master arrives too late to pause anything, and a pause would cost every step a
round trip. So a cut is made of what a shard keeps anyway: its snapshot (a hard link: a snapshot
is replaced, never rewritten) and its ledger's records up to the first push of a step after S.
The shard notes where each step begins in its ledger, and takes its periodic snapshot only
between two steps, so any step since its last snapshot can be cut when the master asks.

Checkpoints every K steps (`--checkpoint-steps`, in the shard's config) are known in advance:
before applying the first push past a multiple C of K, the shard writes the cut of C (links and
a copy of the ledger's head, hashed only when the master asks, as pushes wait meanwhile), so
they survive a later snapshot or a relaunch. A relaunched shard does not know where steps begin
in its replayed ledger: finding no cut of C, it has applied no push after C (that push would
have written one first), so it writes its tables whole as the cut; and it takes a snapshot at
its first push, from which on steps can be cut again. A checkpoint at another step (an epoch's
end, a stop) fails only when a snapshot, or a relaunch, came after S; the master says so in one
line and goes on to the next.

Files: `cuts/S.bin` (snapshot.py's format), `cuts/S.ledger` (records replayed over it; absent for
a cut written whole) and `cuts/S.json` (step, routing epoch and routing, the SHA-256 of .bin and
.ledger), the .json written last. A restore writes `restoring.json` first and removes it last: a
shard that starts and finds it redoes the restore, as a crash between the snapshot's and the
ledger's copies would otherwise leave the cut's snapshot under the later ledger.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil

from elastic_step.durable import fsync_path, write_json_atomic
from elastic_step.ps.ledger import _fsync_dir

CUTS_DIR = "cuts"
RESTORING_FILE = "restoring.json"  # a restore under way: {"step", "digest"}
HASH_CHUNK = 1 << 22
PARTS = ("bin", "ledger")  # a cut's snapshot, then its ledger records: the files its digest covers, in order
FILE_CHUNK = 32 << 20  # a cut's file crosses the network in frames of at most this (a frame's body is bounded)


class CutMissing(ValueError):
    """No cut of that step can be had from this shard (one line, for the master to say)."""


def folder(directory: str) -> str:
    return os.path.join(directory, CUTS_DIR)


def path(directory: str, step: int, ext: str = "bin") -> str:
    return os.path.join(folder(directory), f"{step}.{ext}")


def steps(directory: str) -> list[int]:
    """The steps this shard folder holds complete cuts of (their .json written), ascending."""
    names = os.listdir(folder(directory)) if os.path.isdir(folder(directory)) else []
    return sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())


def digest_of(directory: str, step: int) -> str:
    """SHA-256 of the cut's snapshot, then its ledger records if it has any."""
    ledger = path(directory, step, "ledger")
    return files_digest([path(directory, step), *([ledger] if os.path.exists(ledger) else [])])


def files_digest(files: list[str]) -> str:
    """SHA-256 of these files' bytes, one after the other (a cut's digest, from wherever its files are)."""
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            while chunk := f.read(HASH_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def copy_prefix(source: str, target: str, length: int) -> None:
    """The first `length` bytes of `source` (whole ledger records) as `target`, durably."""
    with open(source, "rb") as f:
        data = f.read(length)
    with open(target, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


def meta(directory: str, step: int) -> dict | None:
    try:
        with open(path(directory, step, "json"), encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def seal(directory: str, step: int, routing: dict, also: list[int] = (), hashed: bool = True) -> dict:
    """After cuts/STEP.bin (and .ledger) are written: its .json, with their SHA-256 unless not
    `hashed` yet (a cut written at a step's first push: hashing a large snapshot there would
    hold every push; `seal` again when the master asks). Each step in `also` (multiples of K
    crossed with no push between) gets the same files by hard links."""
    digest = digest_of(directory, step) if hashed else None
    for other in also:
        for ext in ("bin", "ledger"):
            if os.path.exists(path(directory, step, ext)) and not os.path.exists(path(directory, other, ext)):
                os.link(path(directory, step, ext), path(directory, other, ext))
    written = {}
    for each in [*also, step]:
        written = {"step": each, "epoch": routing["epoch"], "routing": routing, "digest": digest}
        partial = path(directory, each, "json.partial")
        with open(partial, "w", encoding="utf-8") as f:
            json.dump(written, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path(directory, each, "json"))
    _fsync_dir(path(directory, step))
    return written


def retain(directory: str, keep: list[int]) -> None:
    """Forget the cuts a resume can no longer ask for: older than the newest step in `keep` (the
    run's committed checkpoints) and not in it. Newer ones may be of checkpoints still uploading."""
    if keep:
        discard(directory, [old for old in steps(directory) if old < max(keep) and old not in keep])


def discard(directory: str, cut_steps) -> None:
    """Remove whatever files these steps' cuts left, sealed or not: a crash while one was written
    or removed leaves its .bin or .ledger without a .json, which a new cut of that step must not
    take (seal links a .bin that is there, and a digest covers a .ledger that is)."""
    for step in cut_steps:
        for ext in ("json", "bin", "ledger"):  # the .json first: a cut without it is no cut
            with contextlib.suppress(FileNotFoundError):
                os.remove(path(directory, step, ext))


def _held_after(directory: str, step: int) -> list[int]:
    """Every step after `step` with any file in cuts/, sealed or not."""
    names = os.listdir(folder(directory)) if os.path.isdir(folder(directory)) else []
    return sorted({int(head) for head in (n.split(".", 1)[0] for n in names) if head.isdigit() and int(head) > step})


def verified(directory: str, step: int, digest: str) -> dict:
    """The folder's cut of `step` (its meta), when it is the one a checkpoint recorded as `digest`;
    CutMissing (one line) when it is not there or not that one."""
    found = meta(directory, step)
    if found is None or not os.path.exists(path(directory, step)):
        raise CutMissing(f"{directory} has no cut of step {step}")
    if found["digest"] != digest or digest_of(directory, step) != digest:
        raise CutMissing(f"{directory}: the cut of step {step} is not the one the checkpoint recorded (its SHA-256 differs)")
    return found


def restore(directory: str, step: int, digest: str, snapshot_file: str, ledger_file: str, routing_file: str) -> None:
    """Make a shard folder start from its cut of `step` and nothing else: the cut becomes its
    snapshot and ledger (the updates after the cut go), its routing is the cut's, and any cut of
    a later step goes. CutMissing when the cut is not there or is not the one the checkpoint
    names (its digest)."""
    found = verified(directory, step, digest)
    intent = os.path.join(directory, RESTORING_FILE)
    write_json_atomic(intent, {"step": step, "digest": digest})
    _copy_durably(path(directory, step), os.path.join(directory, snapshot_file))
    if os.path.exists(path(directory, step, "ledger")):  # replayed over the snapshot when the shard starts
        _copy_durably(path(directory, step, "ledger"), os.path.join(directory, ledger_file))
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(directory, ledger_file))
    write_json_atomic(os.path.join(directory, routing_file), {**found["routing"], "pending": [], "previous": None})
    discard(directory, _held_after(directory, step))
    _fsync_dir(path(directory, step))  # the later cuts' removal, before the intent's
    os.remove(intent)
    _fsync_dir(intent)


def finish_restore(directory: str, snapshot_file: str, ledger_file: str, routing_file: str) -> int | None:
    """Redo the restore a crash interrupted (its restoring.json is still there): the step it
    restores, or None when none was under way."""
    try:
        with open(os.path.join(directory, RESTORING_FILE), encoding="utf-8") as f:
            pending = json.load(f)
    except FileNotFoundError:
        return None
    restore(directory, int(pending["step"]), str(pending["digest"]), snapshot_file, ledger_file, routing_file)
    return int(pending["step"])


def _copy_durably(source: str, target: str) -> None:
    partial = target + ".partial"
    shutil.copyfile(source, partial)
    fsync_path(partial)
    os.replace(partial, target)
