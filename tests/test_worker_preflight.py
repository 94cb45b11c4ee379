"""A worker's pre-flight: the model definition imports where the worker runs, and the dataset's
manifest and a row of every split can be read from there; each failure is one line saying what
to change."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from elastic_step.worker.preflight import PreflightFailed, check_worker

MODEL_DEF = "elastic_step.model_zoo.digits_torch"


@pytest.fixture
def copied(digits, tmp_path):
    folder = tmp_path / "data"
    shutil.copytree(digits, folder)
    return folder


def test_a_worker_that_can_import_and_read_passes(digits):
    model_def, reader = check_worker(MODEL_DEF, digits)
    assert model_def is not None and reader.read("train", 0, 0, 1)


def test_a_model_definition_missing_from_the_workers_image_is_named(digits):
    with pytest.raises(PreflightFailed) as failed:
        check_worker("model_only_the_master_has", digits)
    message = str(failed.value)
    assert "'model_only_the_master_has' cannot be imported in the worker" in message and "workers' image" in message
    assert len(message.splitlines()) == 1


def test_an_unreadable_manifest_or_shard_is_named_with_what_to_check(copied, tmp_path):
    with pytest.raises(PreflightFailed, match=r"cannot read the dataset's manifest .*credentials too"):
        check_worker(MODEL_DEF, str(tmp_path / "nowhere"))
    manifest = json.loads((copied / "manifest.json").read_text())
    val = manifest["splits"]["val"][0]["path"]
    os.remove(copied / val)  # readable by the master once, not by this worker
    with pytest.raises(PreflightFailed) as failed:
        check_worker(MODEL_DEF, str(copied))
    assert f"cannot read shard {copied / val}" in str(failed.value) or val in str(failed.value)
    assert len(str(failed.value).splitlines()) == 1
