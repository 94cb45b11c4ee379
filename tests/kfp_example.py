"""deploy/examples/kfp_master_env.py applied to a one-step pipeline and compiled by KFP's own
compiler: what a user's pipeline gets from the example, for the tests that check it."""

from __future__ import annotations

import os
import subprocess
import sys

import yaml

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deploy", "examples")


def compiled_example(tmp_path) -> list[dict]:
    """The compiled pipeline's YAML documents (in a subprocess: the example is imported fresh)."""
    module = tmp_path / "pipe.py"
    module.write_text(
        "import sys\nsys.path.insert(0, %r)\n" % EXAMPLES
        + "from kfp import compiler, dsl\nfrom kfp_master_env import as_elastic_master\n"
        "@dsl.component(base_image='python:3.11')\ndef step():\n    pass\n"
        "@dsl.pipeline\ndef pipe():\n    as_elastic_master(step())\n"
        "compiler.Compiler().compile(pipe, sys.argv[1])\n")
    out = tmp_path / "pipe.yaml"
    subprocess.run([sys.executable, str(module), str(out)], check=True, capture_output=True)
    return [d for d in yaml.safe_load_all(out.read_text()) if d]
