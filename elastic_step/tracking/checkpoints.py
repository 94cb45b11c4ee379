"""Checkpoints: the model state of step S (from rank 0) together with the master's ledger as of
step S — one consistent cut. Written to JOB_DIR/checkpoints/step-SSSSSS/ and uploaded to the run
as artifacts `checkpoints/step-SSSSSS/`; the run's tag `elastic_step.checkpoint` is set to S only
after the upload, so a crash mid-upload leaves the previous checkpoint as the newest."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass

log = logging.getLogger("elastic_step.tracking")

LATEST_TAG = "elastic_step.checkpoint"
ALL_TAG = "elastic_step.checkpoints"


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


@dataclass
class Checkpoint:
    step: int
    epoch: int
    state: bytes  # model, optimizer and RNG state, as the framework serialised it
    ledger: dict  # the dispatcher's snapshot as of `step`


def write_local(folder: str, checkpoint: Checkpoint) -> str:
    """Write a checkpoint folder atomically (a temp folder renamed into place)."""
    final = os.path.join(folder, checkpoint_name(checkpoint.step))
    os.makedirs(folder, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".writing-", dir=folder)
    with open(os.path.join(tmp, "state.bin"), "wb") as f:
        f.write(checkpoint.state)
    with open(os.path.join(tmp, "ledger.json"), "w") as f:
        json.dump(checkpoint.ledger, f)
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump({"step": checkpoint.step, "epoch": checkpoint.epoch}, f)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def read_local(path: str) -> Checkpoint:
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    with open(os.path.join(path, "state.bin"), "rb") as f:
        state = f.read()
    with open(os.path.join(path, "ledger.json")) as f:
        ledger = json.load(f)
    return Checkpoint(meta["step"], meta["epoch"], state, ledger)


class CheckpointStore:
    """Saves checkpoints through the run's uploader (so they wait on local disk while MLflow is
    away), keeps the newest `keep`, and finds the newest committed one of a run."""

    def __init__(self, tracker, local_dir: str, keep: int = 3):
        self.tracker = tracker
        self.local_dir = local_dir
        self.keep = keep
        self.committed: list[int] = []  # oldest first, at most `keep`
        self._repository = None

    def save(self, checkpoint: Checkpoint) -> None:
        path = write_local(self.local_dir, checkpoint)
        name = checkpoint_name(checkpoint.step)
        client, run_id = self.tracker.client, self.tracker.run_id

        def upload_and_commit():
            from mlflow.entities import RunTag

            client.log_artifacts(run_id, path, f"checkpoints/{name}")
            everything = self.committed + [checkpoint.step]
            kept, dropped = everything[-self.keep:], everything[:-self.keep]
            # The commit marker and the list of kept checkpoints in one write (one transaction on
            # a database store): a reader sees both or neither. Only then are old ones deleted.
            client.log_batch(run_id, tags=[RunTag(ALL_TAG, ",".join(map(str, kept))), RunTag(LATEST_TAG, str(checkpoint.step))])
            self.committed = kept
            for old in dropped:
                self._delete(old)

        self.tracker.uploader.submit(f"checkpoint {name}", upload_and_commit)

    def _delete(self, step: int) -> None:
        name = checkpoint_name(step)
        try:
            self._artifact_repository().delete_artifacts(f"checkpoints/{name}")
        except Exception as exc:  # an artifact store without deletion keeps it; say so
            log.warning("could not delete old checkpoint %s: %s", name, exc)
        shutil.rmtree(os.path.join(self.local_dir, name), ignore_errors=True)

    def _artifact_repository(self):
        """The run's artifact store, looked up once (its location never changes)."""
        if self._repository is None:
            from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

            run = self.tracker.client.get_run(self.tracker.run_id)
            self._repository = get_artifact_repository(run.info.artifact_uri)
        return self._repository

    def latest(self, run_id: str | None = None) -> Checkpoint | None:
        """The newest committed checkpoint of a run (this job's by default)."""
        client = self.tracker.client
        run = client.get_run(run_id or self.tracker.run_id)
        step = run.data.tags.get(LATEST_TAG)
        if step is None:
            return None
        if run_id is None or run_id == self.tracker.run_id:
            self.committed = [int(s) for s in run.data.tags.get(ALL_TAG, step).split(",") if s]
        target = tempfile.mkdtemp(prefix="checkpoint-")
        path = client.download_artifacts(run.info.run_id, f"checkpoints/{checkpoint_name(int(step))}", target)
        return read_local(path)
