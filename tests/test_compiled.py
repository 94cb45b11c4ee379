"""What `make compile` writes is committed, loads back, and is fresh; users can build their own
pipeline from our components and compile it."""


import os
from pathlib import Path

import pytest
import yaml
from kfp import compiler, dsl
from kfp.components import load_component_from_file

import elastic_step.components as components
from elastic_step.pipelines.compile import COMPONENTS_DIR, PIPELINES, PIPELINES_DIR, compile_all


def same_content(committed: Path, fresh: Path) -> bool:
    """YAML is compared as data: how PyYAML lays out a string depends on what else the process
    imported (Hera, for one, registers a block-style representer for every multi-line str)."""
    if fresh.suffix == ".yaml":
        return list(yaml.safe_load_all(committed.read_text())) == list(yaml.safe_load_all(fresh.read_text()))
    return committed.read_text() == fresh.read_text()


def test_committed_compiled_files_are_fresh(tmp_path):
    if os.environ.get("ELASTIC_STEP_IMAGE"):
        pytest.fail("ELASTIC_STEP_IMAGE is set: committed files use the default image; unset it to compare")
    compile_all(tmp_path / "pipelines", tmp_path / "components")
    stale = []
    for fresh in sorted(tmp_path.rglob("*")):
        if fresh.is_file():
            relative = fresh.relative_to(tmp_path)
            committed = (PIPELINES_DIR / "compiled" / relative.name if relative.parts[0] == "pipelines"
                         else COMPONENTS_DIR / Path(*relative.parts[1:]))
            if not committed.exists() or not same_content(committed, fresh):
                stale.append(str(committed))
    assert not stale, f"stale compiled files (run `make compile` and commit): {stale}"


@pytest.mark.parametrize("name", components.__all__)
def test_component_yaml_loads_back(name):
    loaded = load_component_from_file(str(COMPONENTS_DIR / name / "component.yaml"))
    assert loaded.name == name.replace("_", "-")
    assert set(loaded.component_spec.inputs) == set(getattr(components, name).component_spec.inputs)


@pytest.mark.parametrize("name", list(PIPELINES))
def test_compiled_pipeline_loads_back(name):
    loaded = load_component_from_file(str(PIPELINES_DIR / "compiled" / f"{name}.yaml"))
    assert "mlflow_uri" in loaded.component_spec.inputs and "registered_model" in loaded.component_spec.inputs


@pytest.mark.parametrize("name", list(PIPELINES))
def test_the_pipelines_ps_settings_go_to_the_train_task(name):
    """A run's `mode=ps`, `ps_shards` and `ps_table_limit_mb` (the KFP UI's fields) are what
    train_elastic gets, not its own defaults."""
    spec = next(yaml.safe_load_all((PIPELINES_DIR / "compiled" / f"{name}.yaml").read_text()))
    given = spec["root"]["dag"]["tasks"]["train-elastic"]["inputs"]["parameters"]
    keys = ("mode", "ps_shards", "ps_table_limit_mb")
    assert {key: given.get(key) for key in keys} == {key: {"componentInputParameter": key} for key in keys}


def test_retraining_pipeline_is_never_cached_and_retries_training():
    text = (PIPELINES_DIR / "compiled" / "retraining_pipeline.yaml").read_text()
    assert "enableCache: true" not in text
    assert "retryPolicy" in text and "maxRetryCount: 2" in text
    assert "enableCache: true" in (PIPELINES_DIR / "compiled" / "training_pipeline.yaml").read_text()


def test_a_users_own_pipeline_from_our_components_compiles(tmp_path):
    from elastic_step.components import evaluate_model, prepare_data, train_elastic

    @dsl.pipeline(name="my-team-training")
    def my_pipeline(data_uri: str = "s3://bucket/data.parquet", mlflow_uri: str = "http://mlflow.mlflow:5000"):
        prepared = prepare_data(source=data_uri, split="0.7,0.15,0.15")
        trained = train_elastic(dataset=prepared.outputs["dataset"], model_def="my_team.models.ctr", workers="4:16",
                                backend="kubernetes", mlflow_uri=mlflow_uri)
        evaluate_model(candidate=trained.outputs["model"], dataset=prepared.outputs["dataset"], registered_model="ctr",
                       model_def="my_team.models.ctr", floors={"f1": 0.7}, mlflow_uri=mlflow_uri)

    path = tmp_path / "mine.yaml"
    compiler.Compiler().compile(my_pipeline, str(path))
    loaded = load_component_from_file(str(path))
    assert loaded.name == "my-team-training"
    assert "comp-train-elastic" in path.read_text() and "4:16" in path.read_text()


def test_elastic_step_image_overrides_the_components_image_at_compile_time(tmp_path):
    import subprocess
    import sys

    env = dict(os.environ, ELASTIC_STEP_IMAGE="registry.example.com/team/elastic-step:dev")
    done = subprocess.run([sys.executable, "-m", "elastic_step.pipelines.compile", "--pipelines-out", str(tmp_path / "p"),
                           "--components-out", str(tmp_path / "c")], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    text = (tmp_path / "p" / "training_pipeline.yaml").read_text()
    assert text.count("image: registry.example.com/team/elastic-step:dev") == 6 and "ghcr.io" not in text
