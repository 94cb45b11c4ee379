"""What a worker checks before it takes part in any round: that the model definition imports in
its own image or venv, and that it can read the dataset's manifest and a row of every split from
where it runs. The master checked the same from its own pod; a worker pod has another image,
other credentials and another network, and a failure there is the same on every relaunch. So the
worker tells the master, which fails the job at once with one line saying what to fix."""

from __future__ import annotations

from elastic_step.data.manifest import load_manifest
from elastic_step.data.reader import ShardReader
from elastic_step.frameworks.model_def import load_model_definition


class PreflightFailed(Exception):
    """What this worker cannot do, and what to change so it can."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


def check_worker(model_def_ref: str, manifest_uri: str):
    """(model definition, shard reader) once both work here; else PreflightFailed."""
    try:
        model_def = load_model_definition(model_def_ref)
    except Exception as exc:
        raise PreflightFailed(f"the model definition {model_def_ref!r} cannot be imported in the worker ({_first_line(exc)}); "
                              "install it in the workers' image or venv, not only the master's") from None
    try:
        reader = ShardReader(load_manifest(manifest_uri))
    except Exception as exc:
        raise PreflightFailed(f"the worker cannot read the dataset's manifest {manifest_uri} ({_first_line(exc)}); workers need "
                              "the store's endpoint and credentials too: on Kubernetes give the master's container them from "
                              "a Secret (secretKeyRef), which its worker pods then get by reference") from None
    for split, shards in reader.manifest.splits.items():
        index = next((i for i, shard in enumerate(shards) if shard.rows), None)
        if index is None:
            continue
        try:
            reader.read(split, index, 0, 1)
        except Exception as exc:
            raise PreflightFailed(f"the worker cannot read shard {reader.manifest.shard_uri(split, index)} ({_first_line(exc)}); "
                                  "check that workers may read every object under the dataset's folder") from None
    return model_def, reader
