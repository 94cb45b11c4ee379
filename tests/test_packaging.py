"""What a non-editable install really contains: build the wheel from a copy of exactly what the
image build sees, and check every subpackage, the package data (component YAML and READMEs,
compiled KFP pipelines, Argo YAML) and the entry point are in it, and that it imports from outside
the source tree. An editable install hides all of this, so only a built wheel can show it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# installed package -> source folder, as pyproject.toml maps them
PACKAGE_DIRS = PYPROJECT["tool"]["setuptools"]["package-dir"]
SOURCE_FILES = ["pyproject.toml", "README.md"]
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("context")
    for name in SOURCE_FILES:
        shutil.copy(ROOT / name, src / name)
    for folder in PACKAGE_DIRS.values():
        shutil.copytree(ROOT / folder, src / folder, ignore=IGNORED)
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", "-q", str(src), "-w", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (path,) = out.glob("elastic_step-*.whl")
    return path


def wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def source_files(package: str, patterns: list[str]) -> dict[str, Path]:
    """installed path -> source file, for every file under the package's source folder matching a pattern."""
    folder = ROOT / PACKAGE_DIRS[package]
    found = {}
    for pattern in patterns:
        for path in folder.glob(pattern):
            if "__pycache__" not in path.parts:
                found[package.replace(".", "/") + "/" + path.relative_to(folder).as_posix()] = path
    return found


def test_every_python_module_of_every_package_dir_is_in_the_wheel(wheel):
    names = wheel_names(wheel)
    for package in PACKAGE_DIRS:
        expected = source_files(package, ["**/*.py"])
        assert f"{package.replace('.', '/')}/__init__.py" in expected
        missing = sorted(set(expected) - names)
        assert not missing, f"{package}: not in the wheel (add the subpackage to [tool.setuptools] packages): {missing}"
    assert "elastic_step/model_zoo/digits_torch.py" in names
    assert "elastic_step/backends/kubernetes/__init__.py" in names


def test_component_and_pipeline_yaml_ship_in_the_wheel(wheel):
    names = wheel_names(wheel)
    data = {
        **source_files("elastic_step.components", ["*/component.yaml", "*/README.md"]),
        **source_files("elastic_step.pipelines", ["compiled/*.yaml", "argo/*.yaml"]),
    }
    # the files users load without the Python source: one per component, both pipelines, the Argo workflows
    for component in ["prepare_data", "train_elastic", "evaluate_model", "export_model", "promote_model", "deploy_model"]:
        assert f"elastic_step/components/{component}/component.yaml" in data
    for compiled in ["compiled/training_pipeline.yaml", "compiled/retraining_pipeline.yaml", "argo/training-workflow.yaml"]:
        assert f"elastic_step/pipelines/{compiled}" in data
    missing = sorted(set(data) - names)
    assert not missing, f"package data not in the wheel (see [tool.setuptools.package-data]): {missing}"


def test_only_the_elastic_step_namespace_and_the_entry_point(wheel):
    names = wheel_names(wheel)
    tops = {name.split("/")[0] for name in names}
    assert tops == {"elastic_step", wheel.name.split("-py3")[0] + ".dist-info"}, tops
    with zipfile.ZipFile(wheel) as z:
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        assert "elastic-step = elastic_step.cli:main" in z.read(entry_points).decode()


def test_the_wheel_imports_from_outside_the_source_tree(wheel, tmp_path):
    # From the repository root the source tree's elastic_step/ would shadow the installed one
    # (it has no model_zoo/): run where only the unpacked wheel provides elastic_step.
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    check = (
        "import elastic_step, elastic_step.model_zoo.digits_torch, elastic_step.components.train_elastic, elastic_step.pipelines;"
        "from importlib.resources import files;"
        "print(elastic_step.__file__);"
        "print(files('elastic_step.components').joinpath('train_elastic/component.yaml').is_file(),"
        " files('elastic_step.pipelines').joinpath('compiled/training_pipeline.yaml').is_file())"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    ran = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    where, data = ran.stdout.split("\n")[:2]
    assert Path(where).is_relative_to(site), where
    assert data == "True True"


def test_the_image_build_context_lets_in_every_package_dir():
    dockerignore = (ROOT / ".dockerignore").read_text().split("\n")
    dockerfile = (ROOT / "images" / "Dockerfile").read_text()
    for folder in [*PACKAGE_DIRS.values(), *SOURCE_FILES]:
        assert f"!{folder}" in dockerignore, f".dockerignore keeps {folder} out of the image build"
        assert f" {folder} " in dockerfile or f" {folder}\n" in dockerfile, f"images/Dockerfile does not COPY {folder}"
