import json
import os

import pytest
from kfp.dsl import Dataset, Markdown

from elastic_step.components import prepare_data
from elastic_step.errors import ConfigError, DataError


def test_prepare_data_writes_manifest_shards_and_a_summary(dataset):
    manifest = json.load(open(os.path.join(dataset.path, "manifest.json")))
    rows = {split: sum(s["rows"] for s in shards) for split, shards in manifest["splits"].items()}
    assert rows == {"train": 1437, "val": 180, "test": 180}
    assert dataset.metadata["content_hash"] == manifest["content_hash"]
    summary = open(os.path.join(os.path.dirname(dataset.path), "summary.md")).read()
    assert "| train | 1437 |" in summary and "Class balance" in summary and "pixel_0" in summary


def test_unknown_dataset_is_a_clear_error_and_writes_nothing(tmp_path):
    data = Dataset(uri=str(tmp_path / "dataset"))
    with pytest.raises(DataError, match="nope.*digits|digits.*nope"):
        prepare_data.python_func(source="sklearn:nope", dataset=data, summary=Markdown(uri=str(tmp_path / "s.md")))
    assert not os.path.exists(os.path.join(data.path, "manifest.json"))


def test_bad_split_names_the_input(tmp_path):
    with pytest.raises(ConfigError, match="0.8,x"):
        prepare_data.python_func(source="sklearn:digits", dataset=Dataset(uri=str(tmp_path / "d")),
                                 summary=Markdown(uri=str(tmp_path / "s.md")), split="0.8,x")
