"""The README's CLI block runs as pasted: prepare the data, train, take the run id from `get`,
then evaluate, export and promote against the job folder's own MLflow store, with no tracking
URI set. Only the commands meant for another shell while the job runs (scale, stop, ...) are
left out: the block's train has ended by then."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def cli_block() -> list[str]:
    """The block's commands, one per line (continuations joined), without the while-it-runs part."""
    text = README.read_text(encoding="utf-8")
    block = re.search(r"## The CLI\n\n```bash\n(.*?)\n```", text, re.S).group(1)
    commands, skipping = [], False
    for line in block.replace("\\\n", " ").splitlines():
        if line.startswith("# while it runs"):
            skipping = True
        elif not line.strip():
            skipping = False
        elif not skipping and not line.startswith("#"):
            commands.append(line)
    return commands


def test_the_readme_cli_block_runs_as_pasted(tmp_path):
    commands = cli_block()
    assert [c.split()[1] for c in commands if c.startswith("elastic-step")] == [
        "prepare-data", "train", "evaluate", "export", "promote"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["PATH"] = f"{os.path.dirname(sys.executable)}{os.pathsep}{env['PATH']}"  # elastic-step and python
    script = "set -euo pipefail\n" + "\n".join(commands) + "\n"
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "out/evaluate/blessed").read_text().strip() == "true", done.stdout
    version = (tmp_path / "out/export/model_version").read_text().strip()
    assert "@champion" in done.stdout and version in done.stdout.splitlines()[-1], done.stdout[-2000:]
    assert not (tmp_path / "mlruns").exists() and not (tmp_path / "mlflow.db").exists()  # the job's store, not a new one


def test_a_job_folder_without_its_own_store_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    from elastic_step.cli import main

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["promote", "--registered-model", "digits", "--version", "1", "--job-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--job-dir" in err and "--mlflow-uri" in err
