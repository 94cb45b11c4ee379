"""`make compile`: write every pipeline (KFP IR) to pipelines/compiled/ and every component's
YAML and README beside its code, so users can upload or load them without Python. A test fails when a
committed file is stale. Unset ELASTIC_STEP_IMAGE for the committed files (it sets base_image)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from kfp import compiler

import elastic_step.components as components
from elastic_step.pipelines.component_docs import component_readme
from elastic_step.pipelines.retraining_pipeline import retraining_pipeline
from elastic_step.pipelines.training_pipeline import training_pipeline

PIPELINES = {"training_pipeline": training_pipeline, "retraining_pipeline": retraining_pipeline}
PIPELINES_DIR = Path(__file__).resolve().parent
COMPONENTS_DIR = Path(components.__file__).resolve().parent


def compile_all(pipelines_out: Path = PIPELINES_DIR / "compiled", components_out: Path = COMPONENTS_DIR) -> list[Path]:
    written = []
    pipelines_out.mkdir(parents=True, exist_ok=True)
    for name, pipeline in PIPELINES.items():
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
    args = parser.parse_args()
    if os.environ.get("ELASTIC_STEP_IMAGE"):
        print(f"note: base_image is {os.environ['ELASTIC_STEP_IMAGE']} (ELASTIC_STEP_IMAGE)")
    for path in compile_all(args.pipelines_out, args.components_out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
