"""Step outputs as files, the way Argo (and any runner that is not KFP) collects them: each output
parameter a small text file `DIR/<name>` without a trailing newline, each artifact a file or
folder under DIR. Written to a temporary name and renamed, so a runner never reads half a file."""

from __future__ import annotations

import json
import os
import shutil


def write_parameter(out_dir: str, name: str, value) -> None:
    text = json.dumps(value) if isinstance(value, (dict, list)) else ("true" if value is True else "false" if value is False else str(value))
    _write(os.path.join(out_dir, name), text)


def write_text(out_dir: str, name: str, text: str) -> None:
    _write(os.path.join(out_dir, name), text)


def write_json(out_dir: str, name: str, value) -> None:
    _write(os.path.join(out_dir, name), json.dumps(value, indent=2, sort_keys=True))


def copy_folder(out_dir: str, name: str, source: str) -> None:
    target = os.path.join(out_dir, name)
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
