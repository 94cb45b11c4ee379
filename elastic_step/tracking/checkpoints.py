"""Checkpoints: the model state of step S (from rank 0) together with the master's ledger as of
step S — one consistent cut. Written to JOB_DIR/checkpoints/step-SSSSSS/ and uploaded to the run
as artifacts `checkpoints/step-SSSSSS/`; the run's tag `elastic_step.checkpoint` is set to S only
after the upload, and only once the files (and the audit file the ledger's rows were written to)
are on disk, so a crash mid-upload leaves the previous checkpoint as the newest. `meta.json`
holds a digest of the other two files: a damaged or incomplete download is recognised, and
`latest()` falls back to the next older kept checkpoint."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass

from elastic_step.durable import fsync_dir, fsync_path

log = logging.getLogger("elastic_step.tracking")

LATEST_TAG = "elastic_step.checkpoint"
ALL_TAG = "elastic_step.checkpoints"
BEST_TAG = "elastic_step.best_checkpoint"  # "STEP METRIC VALUE": the best validated one, kept too


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


@dataclass(frozen=True)
class BestRule:
    """Which checkpoint is best: the one with the lowest (`min`) or highest (`max`) value of a
    validation metric (a name the model definition's `metrics()` returns, or `loss`)."""

    metric: str
    mode: str  # "min" or "max"

    def better(self, value: float, than: float | None) -> bool:
        return than is None or (value < than if self.mode == "min" else value > than)


def parse_best_rule(text: str) -> BestRule:
    """`METRIC[:min|max]`; without a mode, `loss` and names ending in `loss` or `error` are
    minimised and every other metric maximised."""
    metric, _, mode = text.partition(":")
    metric = metric.strip()
    if metric.startswith("val_"):
        metric = metric[len("val_"):]
    if not metric or mode not in ("", "min", "max"):
        raise ValueError(f"--keep-best {text!r}: give a validation metric, optionally with :min or :max (e.g. accuracy:max)")
    if not mode:
        mode = "min" if metric.endswith(("loss", "error")) else "max"
    return BestRule(metric, mode)


class CheckpointDamaged(Exception):
    """A checkpoint folder whose files are missing, truncated or altered."""


@dataclass
class Checkpoint:
    step: int
    epoch: int
    state: bytes  # model, optimizer and RNG state, as the framework serialised it
    ledger: dict  # the dispatcher's snapshot as of `step`


def write_local(folder: str, checkpoint: Checkpoint, durable: bool = False) -> str:
    """Write a checkpoint folder atomically (a temp folder renamed into place); `durable` also
    syncs it to disk, which `sync_local` can do later, off the caller's thread."""
    final = os.path.join(folder, checkpoint_name(checkpoint.step))
    os.makedirs(folder, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".writing-", dir=folder)
    ledger = json.dumps(checkpoint.ledger).encode("utf-8")
    meta = {"step": checkpoint.step, "epoch": checkpoint.epoch,
            "sha256": {"state.bin": _digest(checkpoint.state), "ledger.json": _digest(ledger)}}
    for name, data in (("state.bin", checkpoint.state), ("ledger.json", ledger), ("meta.json", json.dumps(meta).encode())):
        with open(os.path.join(tmp, name), "wb") as f:
            f.write(data)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    if durable:
        sync_local(final)
    return final


def sync_local(path: str) -> None:
    """Flush a written checkpoint folder to disk: its files, the folder, and its entry."""
    for name in sorted(os.listdir(path)):
        fsync_path(os.path.join(path, name))
    fsync_dir(path)
    fsync_dir(os.path.dirname(path))


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_local(path: str) -> Checkpoint:
    """A checkpoint folder, checked whole; CheckpointDamaged when it is not."""
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        with open(os.path.join(path, "state.bin"), "rb") as f:
            state = f.read()
        with open(os.path.join(path, "ledger.json"), "rb") as f:
            raw_ledger = f.read()
        digests = meta.get("sha256")
        if digests is not None and (digests.get("state.bin") != _digest(state) or digests.get("ledger.json") != _digest(raw_ledger)):
            raise CheckpointDamaged(f"checkpoint {path}: a file does not match its digest in meta.json")
        return Checkpoint(int(meta["step"]), int(meta["epoch"]), state, json.loads(raw_ledger))
    except CheckpointDamaged:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointDamaged(f"checkpoint {path} is incomplete or damaged: {type(exc).__name__}: {exc}") from None


class CheckpointStore:
    """Saves checkpoints through the run's uploader (so they wait on local disk while MLflow is
    away), keeps the newest `keep`, and finds the newest committed one of a run."""

    def __init__(self, tracker, local_dir: str, keep: int = 3, sync_before_commit: list[str] | None = None,
                 keep_best: BestRule | None = None):
        self.tracker = tracker
        self.local_dir = local_dir
        self.keep = keep
        # Files a commit vouches for besides the checkpoint's own (the audit file): on disk first.
        self.sync_before_commit = [p for p in (sync_before_commit or []) if p]
        self.committed: list[int] = []  # oldest first: the newest `keep`, and the best one
        self.keep_best = keep_best
        self.best: tuple[int, float] | None = None  # (step, value) of the best validated checkpoint
        self._repository = None

    def _retained(self, steps: list[int]) -> tuple[list[int], list[int]]:
        """(kept, dropped) of these committed steps: the newest `keep`, and the best one."""
        newest = steps[-self.keep:]
        kept = sorted(set(newest) | ({self.best[0]} if self.best and self.best[0] in steps else set()))
        return kept, [s for s in steps if s not in kept]

    def save(self, checkpoint: Checkpoint) -> None:
        path = write_local(self.local_dir, checkpoint)
        name = checkpoint_name(checkpoint.step)
        client, run_id = self.tracker.client, self.tracker.run_id

        def upload_and_commit():
            from mlflow.entities import RunTag

            # On disk before anything says it exists: the checkpoint, and the audit lines of the
            # steps it covers (written before the checkpoint was handed over).
            sync_local(path)
            for extra in self.sync_before_commit:
                if os.path.exists(extra):
                    fsync_path(extra)
            client.log_artifacts(run_id, path, f"checkpoints/{name}")
            kept, dropped = self._retained(self.committed + [checkpoint.step])
            # The commit marker and the list of kept checkpoints in one write (one transaction on
            # a database store): a reader sees both or neither. Only then are old ones deleted.
            client.log_batch(run_id, tags=[RunTag(ALL_TAG, ",".join(map(str, kept))), RunTag(LATEST_TAG, str(checkpoint.step))])
            self.committed = kept
            for old in dropped:
                self._delete(old)

        self.tracker.uploader.submit(f"checkpoint {name}", upload_and_commit)

    def validated(self, step: int, metrics: dict) -> bool:
        """Called (on the uploader's thread, so after the checkpoint of `step` is committed) with
        the validation metrics of that checkpoint: when it is the best so far under `keep_best`,
        it is kept beyond the newest `keep` and named by the run's BEST_TAG. True when it is."""
        rule = self.keep_best
        if rule is None or step not in self.committed:
            return False
        if rule.metric not in metrics:
            log.warning("--keep-best %s: validation gave no such metric (it gave %s)", rule.metric, ", ".join(sorted(metrics)))
            return False
        value = float(metrics[rule.metric])
        if not rule.better(value, self.best[1] if self.best else None):
            return False
        from mlflow.entities import RunTag

        previous, self.best = self.best, (step, value)
        kept, dropped = self._retained(self.committed)
        try:
            self.tracker.client.log_batch(self.tracker.run_id, tags=[
                RunTag(ALL_TAG, ",".join(map(str, kept))), RunTag(BEST_TAG, f"{step} {rule.metric} {value!r}")])
        except Exception:  # the uploader retries this call: then it must still be better than the best recorded
            self.best = previous
            raise
        self.committed = kept
        for old in dropped:
            self._delete(old)
        return True

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
        """The newest committed checkpoint of a run (this job's by default) that downloads whole;
        a damaged or incomplete one is skipped for the next older kept one, with a warning."""
        client = self.tracker.client
        run = client.get_run(run_id or self.tracker.run_id)
        step = run.data.tags.get(LATEST_TAG)
        if step is None:
            return None
        kept = sorted({int(s) for s in run.data.tags.get(ALL_TAG, step).split(",") if s} | {int(step)})
        kept = [s for s in kept if s <= int(step)]
        if run_id is None or run_id == self.tracker.run_id:
            self.committed = kept
            self.best = _best_of(run.data.tags, self.keep_best)
        return self._download_newest(run, kept, int(step))

    def best_checkpoint(self, run_id: str) -> Checkpoint:
        """The best validated checkpoint a run kept (`--keep-best`); a clear error otherwise."""
        from elastic_step.tracking.run import TrackingError

        run = self.tracker.client.get_run(run_id)
        tag = run.data.tags.get(BEST_TAG)
        if not tag:
            raise TrackingError(f"run {run_id} kept no best checkpoint (it ran without --keep-best, or no validation "
                                "finished); name the run alone to start from its newest checkpoint")
        return self._download_newest(run, [int(tag.split()[0])], int(tag.split()[0]))

    def _download_newest(self, run, kept: list[int], step: int) -> Checkpoint:
        """The newest of these checkpoints of a run that downloads whole."""
        client = self.tracker.client
        problems = []
        for candidate in reversed(kept):
            target = tempfile.mkdtemp(prefix="checkpoint-")
            try:
                path = client.download_artifacts(run.info.run_id, f"checkpoints/{checkpoint_name(candidate)}", target)
                checkpoint = read_local(path)
                if checkpoint.step != candidate:
                    raise CheckpointDamaged(f"checkpoint {checkpoint_name(candidate)} says it is of step {checkpoint.step}")
            except Exception as exc:  # damaged, incomplete, or gone from the artifact store
                problems.append(f"{checkpoint_name(candidate)}: {type(exc).__name__}: {str(exc)[:200]}")
                log.warning("checkpoint %s of run %s cannot be used (%s); trying an older one",
                            checkpoint_name(candidate), run.info.run_id, problems[-1])
                continue
            finally:
                shutil.rmtree(target, ignore_errors=True)
            if problems:
                print(f"checkpoint {checkpoint_name(step)} of run {run.info.run_id} is damaged; "
                      f"using the older {checkpoint_name(candidate)}", file=sys.stderr)
            return checkpoint
        from elastic_step.tracking.run import TrackingError

        raise TrackingError(
            f"run {run.info.run_id} has committed checkpoints but none of them can be read ({'; '.join(problems)}); "
            "rerun without --resume (or with another --job-name) to start afresh"
        )


def _best_of(tags: dict, rule: BestRule | None) -> tuple[int, float] | None:
    """The (step, value) a run's BEST_TAG records, when it was chosen by the same metric."""
    parts = tags.get(BEST_TAG, "").split()
    if rule is None or len(parts) != 3 or parts[1] != rule.metric:
        return None
    return int(parts[0]), float(parts[2])
