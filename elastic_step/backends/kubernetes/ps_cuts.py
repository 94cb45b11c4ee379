"""A `--mode ps` job's checkpoint cuts on the Kubernetes backend: from the shard pods into the
checkpoint store, and from there into a resumed job's new shard pods.

A shard pod's folder is an emptyDir: it goes with the pod, and a resumed job (a new master pod,
so new shard pods) could not read it. So each checkpoint's cut (ps/cuts.py) goes where the dense
checkpoint goes, the run's artifacts in MLflow. Once every shard has cut step S, the master
copies each shard's cut files (the shard's `cut_file` request, in parts) into
JOB_DIR/ps-cuts/step-SSSSSS, checks them against the digest the shard gave, and queues their
upload as the run's `ps-cuts/step-SSSSSS/shard-I.{bin,ledger}` on the run's uploader ahead of
the checkpoint itself: the uploader runs in order, so the run's commit of step S comes after its
cut's files. A checkpoint whose cut cannot be copied is not taken (one line). Each checkpoint
so carries every shard's snapshot through the master's disk and network: with tables of many
GiB, choose --checkpoint-steps with that in mind.

A resume downloads each shard's cut of the checkpoint's step, checks it against the digest the
checkpoint recorded, and starts the shard pods with that step and digest in their env
(RESTORE_ENV). Such a pod first listens for its cut alone (`receive_cut`, the job's token
checked): the master sends the files (`restore_part`, then `restore_done`); the pod writes them
as its folder's cut of S, and cuts.restore makes them its snapshot and ledger only when their
SHA-256 is its env's digest, as a local shard's folder is put back. Then the shard starts from
them. A container the kubelet restarts later in the same pod finds its folder restored and
starts at once. The shards never reach MLflow: the master, which holds the run's credentials,
carries the bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
import socketserver
import threading

import numpy as np

from elastic_step.ps import cuts, wire
from elastic_step.ps.cuts import PARTS
from elastic_step.ps.api import PsError, Status
from elastic_step.ps.client import PsClient
from elastic_step.ps.state import LEDGER_FILE, ROUTING_FILE, SNAPSHOT_FILE, write_fence

log = logging.getLogger("elastic_step.backends.kubernetes")

ARTIFACTS = "ps-cuts"  # the run's artifact folder of the shards' cuts, one folder per checkpoint
RESTORED_FILE = "restored.json"  # in a shard pod's folder: its cut is in place (a restarted container skips the wait)
RESTORING = "restoring"  # what a pod waiting for its cut answers `stats`: not serving yet


def step_folder(step: int) -> str:
    return f"step-{step:06d}"


def part_name(index: int, part: str) -> str:
    return f"shard-{index}.{part}"


# -- the master: a checkpoint's cut from the pods to the checkpoint store --------------------------
def fetch_cut(client: PsClient, endpoint: str, step: int, folder: str, index: int, digest: str) -> None:
    """Shard `index`'s cut files of `step` (at `endpoint`) as FOLDER/shard-I.bin and .ledger;
    PsError unless they hash to `digest`."""
    hasher = hashlib.sha256()
    for part in PARTS:
        target = os.path.join(folder, part_name(index, part))
        with open(target + ".partial", "wb") as out:
            offset, size = 0, 1
            while offset < size:
                header, body = client.call(endpoint, {"op": "cut_file", "step": step, "part": part, "offset": offset})
                if header.get("status") != Status.OK:
                    raise PsError(f"shard {index} did not give its cut of step {step}: {header.get('detail') or header.get('status')}")
                size = int(header["size"])
                if not body and offset < size:
                    raise PsError(f"shard {index}'s cut of step {step} ended at {offset} of {size} bytes")
                out.write(body)
                hasher.update(body)
                offset += len(body)
        os.replace(target + ".partial", target)
    if hasher.hexdigest() != digest:
        raise PsError(f"shard {index}'s cut files of step {step} do not hash to the digest it gave")


class CutStore:
    """The shards' cuts among the run's artifacts, beside its checkpoints (`checkpoints`: the
    run's tracking/checkpoints.CheckpointStore, whose uploader and commits they follow)."""

    def __init__(self, checkpoints, job_dir: str):
        self.checkpoints = checkpoints
        self.local = os.path.join(job_dir, ARTIFACTS)

    def folder(self, step: int) -> str:
        """An empty folder for the cut of `step` (step_path)."""
        path = self.step_path(step)
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        return path

    def step_path(self, step: int) -> str:
        """Where this master copies a checkpoint's cut from the shard pods."""
        return os.path.join(self.local, step_folder(step))

    def resumed_path(self, step: int) -> str:
        """Where a resume downloads a checkpoint's cut from the run's artifacts."""
        return os.path.join(self.local, "resumed", step_folder(step))

    def keep(self, step: int, folder: str) -> None:
        """Queue the upload of `folder` (a checkpoint's cut files) ahead of that checkpoint's."""
        tracker = self.checkpoints.tracker

        def upload() -> None:
            tracker.client.log_artifacts(tracker.run_id, folder, f"{ARTIFACTS}/{step_folder(step)}")
            self._retain()

        tracker.uploader.submit(f"parameter-server cuts of step {step}", upload)

    def _retain(self) -> None:
        """Drop the cuts no committed checkpoint needs: older than the newest committed one and
        not kept (the run's checkpoints went the same way). Newer ones may be of checkpoints
        still queued."""
        committed = list(self.checkpoints.committed)
        tracker = self.checkpoints.tracker
        if not committed:
            return
        for entry in tracker.client.list_artifacts(tracker.run_id, ARTIFACTS):
            name = os.path.basename(entry.path)
            step = int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None
            if step is None or step >= max(committed) or step in committed:
                continue
            shutil.rmtree(os.path.join(self.local, name), ignore_errors=True)
            try:
                self._repository().delete_artifacts(f"{ARTIFACTS}/{name}")
            except Exception as exc:  # an artifact store without deletion keeps it; say so
                log.warning("could not delete the parameter-server cuts %s: %s", name, exc)

    def _repository(self):
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

        tracker = self.checkpoints.tracker
        return get_artifact_repository(tracker.client.get_run(tracker.run_id).info.artifact_uri)

    def download(self, step: int, index: int, digest: str) -> dict[str, str]:
        """Shard `index`'s cut of `step` from the run's artifacts, as {part: local path}; ValueError
        (one line) when it is not there or does not hash to `digest`."""
        tracker = self.checkpoints.tracker
        target = self.resumed_path(step)
        os.makedirs(target, exist_ok=True)
        files = {}
        for part in PARTS:
            name = f"{ARTIFACTS}/{step_folder(step)}/{part_name(index, part)}"
            try:
                files[part] = tracker.client.download_artifacts(tracker.run_id, name, target)
            except Exception as exc:
                raise ValueError(f"the run has no {name} ({type(exc).__name__})") from None
        if cuts.files_digest([files[part] for part in PARTS]) != digest:
            raise ValueError(f"the run's {ARTIFACTS}/{step_folder(step)} of shard {index} is not the cut the checkpoint recorded "
                             "(its SHA-256 differs)")
        return files


def send_cut(client: PsClient, endpoint: str, files: dict[str, str]) -> None:
    """A resumed shard pod's cut, sent to the pod that waits for it (`receive_cut`); PsError
    with the pod's reason when it refuses them."""
    for part in PARTS:
        with open(files[part], "rb") as f:
            offset = 0
            while chunk := f.read(cuts.FILE_CHUNK):
                header, _ = client.call(endpoint, {"op": "restore_part", "part": part, "offset": offset}, np.frombuffer(chunk, np.uint8))
                if header.get("status") != Status.OK:
                    raise PsError(str(header.get("detail") or header.get("status")))
                offset += len(chunk)
    header, _ = client.call(endpoint, {"op": "restore_done"})
    if header.get("status") != Status.OK:
        raise PsError(str(header.get("detail") or header.get("status")))


# -- a resumed shard pod: its cut from the master, before the shard starts --------------------------
def restored(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, RESTORED_FILE))


def receive_cut(directory: str, host: str, port: int, token: str, restore: dict) -> None:
    """Listen at the shard's address until the master has sent this shard's cut of
    restore["step"] and it hashes to restore["digest"]; then the folder starts from it.
    cuts.CutMissing (one line) when what it sent does not: nothing of it is kept."""
    done, refused = threading.Event(), []
    connections: set[socket.socket] = set()

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            connections.add(self.request)
            try:
                if done.is_set():  # accepted as the wait ended, after its connections were closed
                    return
                if _restore_connection(self.request, directory, token.encode(), restore):
                    done.set()
            except cuts.CutMissing as exc:
                refused.append(exc)
                done.set()
            finally:
                connections.discard(self.request)

    with _Server((host, port), Handler) as server:
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
        done.wait()
        server.shutdown()
        # A client that asked before the cut came (the master's stats poll, its validation's pulls)
        # keeps its connection, and this process goes on to be the shard: its handler would answer
        # 'restoring' on it for good. Closed, the client connects again, to the shard itself.
        for connection in list(connections):
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
    if refused:
        raise refused[0]


class _Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True  # the shard binds the same address once this one is closed
    daemon_threads = True
    request_queue_size = 128  # as the shard's: every worker and the master may connect at once


def _restore_connection(connection: socket.socket, directory: str, token: bytes, restore: dict) -> bool:
    """One client's requests; True once the cut is in place (one connection sends it: the master's).
    cuts.CutMissing when the cut it sent is not the one of RESTORE_ENV."""
    receiving = None
    while True:
        try:
            header, body = wire.receive(connection)
        except (ConnectionError, wire.FrameError, ValueError, OSError):
            return False
        if not wire.authorized(connection, header, token):
            return False
        op = header.get("op")
        if op not in ("restore_part", "restore_done"):  # `stats` and anything else: not serving yet
            wire.send(connection, {"status": RESTORING, "detail": "waiting for its checkpoint's cut from the master"})
            continue
        try:
            receiving = receiving or _Receiving(directory, int(restore["step"]))
            if op == "restore_part":
                receiving.write(str(header["part"]), int(header["offset"]), body)
            else:
                receiving.finish(str(restore["digest"]), restore["routing"], int(restore.get("fence", 0)))
        except (cuts.CutMissing, KeyError, ValueError) as exc:
            if receiving is not None:
                receiving.discard()
            if isinstance(exc, cuts.CutMissing):  # the master's cut is not this shard's: it stops the resume
                wire.send(connection, {"status": Status.NO_CUT, "detail": str(exc)[:300]})
                raise
            wire.send(connection, {"status": Status.BAD_REQUEST, "detail": str(exc)[:200]})
            return False
        wire.send(connection, {"status": Status.OK})
        if op == "restore_done":
            return True


class _Receiving:
    """The cut's parts as they arrive, in order, into the folder's cuts/STEP.*.partial."""

    def __init__(self, directory: str, step: int):
        self.directory, self.step = directory, step
        self.sizes = {part: 0 for part in PARTS}
        os.makedirs(cuts.folder(directory), exist_ok=True)
        for part in PARTS:
            with open(self._partial(part), "wb"):
                pass

    def _partial(self, part: str) -> str:
        return cuts.path(self.directory, self.step, part) + ".partial"

    def write(self, part: str, offset: int, body: bytearray) -> None:
        if part not in PARTS or offset != self.sizes[part]:
            raise ValueError(f"part {part!r} at {offset}: expected one of {PARTS} at the end of what arrived")
        with open(self._partial(part), "ab") as f:
            f.write(body)
        self.sizes[part] += len(body)

    def finish(self, digest: str, routing: dict, fence: int = 0) -> None:
        """The parts as the folder's cut of the step, then its snapshot and ledger (cuts.restore:
        CutMissing unless they hash to `digest`), and a rollback's `fence` (ps_rollback.py)."""
        for part in PARTS:
            with open(self._partial(part), "rb+") as f:
                os.fsync(f.fileno())
            os.replace(self._partial(part), cuts.path(self.directory, self.step, part))
        meta = {"step": self.step, "epoch": routing["epoch"], "routing": routing, "digest": digest}
        with open(cuts.path(self.directory, self.step, "json"), "w", encoding="utf-8") as f:
            json.dump(meta, f)
        try:
            cuts.restore(self.directory, self.step, digest, SNAPSHOT_FILE, LEDGER_FILE, ROUTING_FILE)
        except cuts.CutMissing:
            for ext in ("json", *PARTS):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(cuts.path(self.directory, self.step, ext))
            raise
        if fence:
            write_fence(self.directory, fence)
        with open(os.path.join(self.directory, RESTORED_FILE), "w", encoding="utf-8") as f:
            json.dump({"step": self.step}, f)

    def discard(self) -> None:
        for part in PARTS:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._partial(part))
