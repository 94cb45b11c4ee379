"""Images for a cluster: one name, `REGISTRY/elastic-step-VARIANT:VERSION` (elastic_step.images),
is what `make images` builds and tags, what `make push IMAGE_REGISTRY=...` pushes, what `make
compile` and `argo render` write into the YAML (`--image`, or `--image-registry` with the package's
version) and what deploy/'s kustomize `images:` entry names. A committed YAML file that names any
other image — another registry, an older version, a typo — is refused here, so what is shipped
always runs the image the Makefile produces.

Not exercised here: `docker build` and `docker push` themselves (no registry on this machine;
`make image-smoke` builds, runs and pushes both images with its own Docker daemon). The Makefile's
commands are read with `make -n`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from elastic_step import __version__
from elastic_step.images import REGISTRY, VARIANTS, chosen_image, image_name

ROOT = Path(__file__).resolve().parent.parent
# Where committed YAML names images: the compiled KFP pipelines, the components' YAML, the Argo
# documents and everything under deploy/.
COMMITTED = ("pipelines/compiled/", "pipelines/argo/", "components/", "deploy/")


def committed_yaml() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *COMMITTED], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / p for p in listed if p.endswith((".yaml", ".yml")) and (ROOT / p).is_file()]


def images_in(document) -> list[str]:
    """Every container image a Kubernetes, Argo or KFP document names (`image: ...` at any depth),
    and every image a kustomization's `images:` entry sets."""
    found = []
    if isinstance(document, dict):
        if document.get("kind") == "Kustomization" or "newName" in document or "newTag" in document:
            for entry in document.get("images") or []:
                found.append(f"{entry.get('newName', entry['name'])}:{entry.get('newTag', '')}")
        for key, value in document.items():
            if key == "image" and isinstance(value, str):
                found.append(value)
            elif key != "images":
                found += images_in(value)
    elif isinstance(document, list):
        for item in document:
            found += images_in(item)
    return found


def foreign_images(paths: list[Path], allowed: set[str]) -> list[str]:
    offenders = []
    for path in paths:
        for document in yaml.safe_load_all(path.read_text()):
            offenders += [f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: {image}"
                          for image in images_in(document) if image not in allowed]
    return offenders


PACKAGE_IMAGES = {image_name(variant) for variant in VARIANTS}


def test_committed_yaml_names_only_the_packages_images_in_the_configured_registry():
    paths = committed_yaml()
    assert foreign_images(paths, PACKAGE_IMAGES) == [], (
        f"committed YAML names images other than {sorted(PACKAGE_IMAGES)}: run `make compile` (and fix deploy/)")
    # Not vacuous: every kind of file above does name the image.
    naming = [str(p.relative_to(ROOT)) for p in paths if any(images_in(d) for d in yaml.safe_load_all(p.read_text()))]
    assert all(any(p.startswith(folder) for p in naming) for folder in COMMITTED), naming


def test_the_check_refuses_another_registry_an_older_version_and_a_typo(tmp_path):
    ours = image_name("torch")
    planted = tmp_path / "planted.yaml"
    planted.write_text(yaml.safe_dump_all([
        {"kind": "Pod", "spec": {"containers": [{"name": "a", "image": ours}]}},
        {"kind": "Pod", "spec": {"initContainers": [{"name": "b", "image": f"docker.io/someone/elastic-step-torch:{__version__}"}]}},
        {"spec": {"templates": [{"container": {"image": f"{REGISTRY}/elastic-step-torch:0.0.9"}}]}},
        {"deploymentSpec": {"executors": {"x": {"container": {"image": f"{REGISTRY}/elastic-step-troch:{__version__}"}}}}},
        {"kind": "Kustomization", "images": [{"name": "x", "newName": f"{REGISTRY}/elastic-step-torch", "newTag": "latest"}]},
    ]))
    offenders = foreign_images([planted], PACKAGE_IMAGES)
    assert [o.split(": ", 1)[1] for o in offenders] == [
        f"docker.io/someone/elastic-step-torch:{__version__}", f"{REGISTRY}/elastic-step-torch:0.0.9",
        f"{REGISTRY}/elastic-step-troch:{__version__}", f"{REGISTRY}/elastic-step-torch:latest"]


def make_n(*args: str) -> list[str]:
    done = subprocess.run(["make", "-n", "-C", str(ROOT), *args], capture_output=True, text=True, check=True)
    return [line for line in done.stdout.splitlines() if line.startswith("docker ")]


def test_make_images_and_push_use_the_names_of_elastic_step_images():
    registry, version = "registry.example.com:5000/team", "0.1.0-rc1"
    build = make_n("images", f"IMAGE_REGISTRY={registry}", f"IMAGE_VERSION={version}")
    push = make_n("push", f"IMAGE_REGISTRY={registry}", f"IMAGE_VERSION={version}")
    for variant in VARIANTS:
        local = f"elastic-step-{variant}:{__version__}"
        extras = "torch" if variant == "torch" else "torch,tensorflow"
        assert any(f"build -f images/Dockerfile --build-arg EXTRAS={extras} " in c and c.endswith(f"-t {local} .")
                   for c in build), build
        assert f"docker tag {local} {image_name(variant, registry, version)}" in build
        assert push[push.index(f"docker tag {local} {image_name(variant, registry, version)}") + 1] == \
            f"docker push {image_name(variant, registry, version)}"
    # With nothing set, the Makefile's registry and version are the ones the shipped YAML names.
    assert {c.split()[-1] for c in make_n("push") if c.startswith("docker push")} == PACKAGE_IMAGES


def test_make_compile_passes_the_makefiles_registry_and_version():
    done = subprocess.run(["make", "-n", "-C", str(ROOT), "compile", "IMAGE_REGISTRY=r.example/t", "IMAGE_VERSION=9"],
                          capture_output=True, text=True, check=True).stdout
    assert done.count("--image-registry r.example/t --image-version 9") == 2, done


def test_compile_and_render_write_a_clusters_registry_everywhere(tmp_path):
    registry = "registry.example.com:5000/team"
    expected = {image_name("torch", registry)}
    env = {k: v for k, v in os.environ.items() if k != "ELASTIC_STEP_IMAGE"}
    # The two programs run side by side (each spends most of its time importing).
    compiling = subprocess.Popen([sys.executable, "-m", "elastic_step.pipelines.compile", "--image-registry", registry,
                                  "--pipelines-out", str(tmp_path / "kfp"), "--components-out", str(tmp_path / "components")],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    rendered = subprocess.run([sys.executable, "-m", "elastic_step.cli", "argo", "render", "--pipeline", "all",
                               "--out", str(tmp_path / "argo"), "--image-registry", registry], capture_output=True, text=True, env=env)
    compile_errors = compiling.communicate(timeout=600)[1]
    assert compiling.returncode == 0, compile_errors
    assert rendered.returncode == 0, rendered.stderr
    paths = sorted(tmp_path.rglob("*.yaml"))
    assert len(paths) == 2 + 6 + 5 and foreign_images(paths, expected) == []
    assert all("ghcr.io" not in p.read_text() for p in paths)
    # The worker pods the train step launches get the same image (ELASTIC_STEP_IMAGE in its env).
    template = yaml.safe_load((tmp_path / "argo" / "training-workflowtemplate.yaml").read_text())
    train = next(t for t in template["spec"]["templates"] if t["name"] == "train")
    assert {"name": "ELASTIC_STEP_IMAGE", "value": image_name("torch", registry)} in train["container"]["env"]


@pytest.mark.parametrize("flags", [["--image-registry", "Registry.Example/team"], ["--image-version", "v 1"],
                                   ["--image", "x:1", "--image-registry", "r.example/t"]])
def test_compile_refuses_a_bad_registry_or_version_in_one_line(tmp_path, flags):
    done = subprocess.run([sys.executable, "-m", "elastic_step.pipelines.compile", *flags, "--pipelines-out",
                           str(tmp_path / "p"), "--components-out", str(tmp_path / "c")], capture_output=True, text=True)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "p").exists()


def test_chosen_image_prefers_what_was_asked(monkeypatch):
    monkeypatch.setenv("ELASTIC_STEP_IMAGE", "from-env:1")
    assert chosen_image() == "from-env:1"
    assert chosen_image(image="given:2") == "given:2"
    assert chosen_image(registry="r.example/t") == f"r.example/t/elastic-step-torch:{__version__}"
    assert chosen_image(version="1.2.3") == f"{REGISTRY}/elastic-step-torch:1.2.3"


def test_a_kustomize_images_override_points_deploy_at_a_clusters_registry(tmp_path):
    base = tmp_path / "deploy"
    shutil.copytree(ROOT / "deploy", base)
    built = subprocess.run(["kubectl", "kustomize", str(base / "mlflow")], capture_output=True, text=True, check=True).stdout
    assert set(images_in(list(yaml.safe_load_all(built)))) == {image_name("torch")}
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    ours = image_name("torch", "registry.example.com:5000/team", "0.1.0-rc1")
    name, tag = ours.rsplit(":", 1)
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": ["../deploy/mlflow"],
        "images": [{"name": f"{REGISTRY}/elastic-step-torch", "newName": name, "newTag": tag}]}))
    built = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, check=True).stdout
    assert set(images_in(list(yaml.safe_load_all(built)))) == {ours}
