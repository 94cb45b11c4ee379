"""`make compile`: write every pipeline (KFP IR) to pipelines/compiled/ and every component's
YAML and README beside its code, so users can upload or load them without Python. A test fails when a
committed file is stale, or names another image than the package's version in the project's registry.

The image is the components' `base_image`, fixed when they are imported: `--image`, or
`--image-registry` (with `--image-version`, default the package's), else ELASTIC_STEP_IMAGE, else the
project's image (elastic_step.images). For a cluster's own registry, compile into folders of your
own (`--pipelines-out`, `--components-out`) rather than over the committed files."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from pathlib import Path

from elastic_step.images import ImageNameError, chosen_image

PIPELINES = ("training_pipeline", "retraining_pipeline")
PIPELINES_DIR = Path(__file__).resolve().parent
# Found without importing the components: importing them fixes their image.
COMPONENTS_DIR = Path(importlib.util.find_spec("elastic_step.components").origin).resolve().parent


def compile_all(pipelines_out: Path = PIPELINES_DIR / "compiled", components_out: Path = COMPONENTS_DIR) -> list[Path]:
    """Compile with the image the components were (or are now) imported with."""
    from kfp import compiler

    import elastic_step.components as components
    from elastic_step.pipelines.component_docs import component_readme

    written = []
    pipelines_out.mkdir(parents=True, exist_ok=True)
    for name in PIPELINES:
        pipeline = getattr(importlib.import_module(f"elastic_step.pipelines.{name}"), name)
        path = pipelines_out / f"{name}.yaml"
        compiler.Compiler().compile(pipeline, str(path))
        written.append(path)
    for name in components.__all__:
        path = components_out / name / "component.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        compiler.Compiler().compile(getattr(components, name), str(path))
        readme = path.parent / "README.md"
        readme.write_text(component_readme(name, getattr(components, name)))
        written += [path, readme]
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipelines-out", type=Path, default=PIPELINES_DIR / "compiled")
    parser.add_argument("--components-out", type=Path, default=COMPONENTS_DIR)
    parser.add_argument("--image", help="every component's image (a full reference)")
    parser.add_argument("--image-registry", metavar="REGISTRY",
                        help="REGISTRY/elastic-step-torch:VERSION as every component's image (the name `make push` pushes)")
    parser.add_argument("--image-version", metavar="VERSION", help="with --image-registry: the tag (default: the package's version)")
    args = parser.parse_args()
    if "elastic_step.components" in sys.modules:  # cannot happen from the command line; say so if it ever does
        parser.exit(1, "compile: the components are already imported, so their image is fixed; run this as a program\n")
    try:
        image = chosen_image(args.image, args.image_registry, args.image_version)
    except ImageNameError as exc:
        parser.exit(2, f"compile: {exc}\n")
    os.environ["ELASTIC_STEP_IMAGE"] = image  # read once, when the components are decorated on import
    print(f"image: {image}")
    for path in compile_all(args.pipelines_out, args.components_out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
