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


def test_categorical_and_bucket_specs_reach_the_manifest_and_the_summary(tmp_path):
    source = tmp_path / "ads.csv"
    source.write_text("site,device,age,label\n" + "".join(
        f"site-{i % 7},{['ios', 'web'][i % 2]},{20 + i % 50},{i % 2}\n" for i in range(200)))
    data, summary = Dataset(uri=str(tmp_path / "d")), Markdown(uri=str(tmp_path / "s.md"))
    prepare_data.python_func(source=str(source), dataset=data, summary=summary, categorical="site=hash:16;device",
                             buckets="age=30,40")
    recorded = json.load(open(os.path.join(data.path, "manifest.json")))["categorical"]
    assert recorded["site"] == {"encoding": "hash", "num_bins": 16} and recorded["age"]["boundaries"] == [30.0, 40.0]
    assert sorted(recorded["device"]["vocabulary"]) == ["ios", "web"]
    assert "| device | vocabulary | 3 |" in open(summary.path).read()  # two values and one out-of-vocabulary bucket


def test_a_string_column_without_a_spec_is_refused_before_anything_is_written(tmp_path):
    source = tmp_path / "ads.csv"
    source.write_text("site,label\n" + "".join(f"s{i},{i % 2}\n" for i in range(50)))
    data = Dataset(uri=str(tmp_path / "d"))
    with pytest.raises(DataError, match="feature column 'site'.*--categorical site=vocab"):
        prepare_data.python_func(source=str(source), dataset=data, summary=Markdown(uri=str(tmp_path / "s.md")))
    assert not os.path.exists(os.path.join(data.path, "manifest.json"))
