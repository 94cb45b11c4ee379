"""Every command the tutorials (docs/tutorials/) and the README show exists as written, played or
not: each `elastic-step` command and subcommand with each of its flags, each `python -m
elastic_step.pipelines.compile` flag, each `make` target with its variables (`make -n`), the
`kfp` client the tutorials call, and each file or folder of the repository a command names
(`kubectl apply -k deploy/...`). A renamed flag or a moved kustomization fails here, not in a
platform engineer's terminal. Whether the commands do what the text says is tested elsewhere:
tests/test_tutorials.py plays the tutorials on the cluster stand-in, `make image-smoke` builds,
pushes and pulls the image."""

from __future__ import annotations

import argparse
import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_step.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs" / "tutorials").glob("*.md")) + [ROOT / "README.md"]
BASH = re.compile(r"```bash\n(.*?)```", re.S)
ENDS = {"|", "||", "&&", ";", "&"}
ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
# Paths of this repository a command may name (a token that starts with one must exist).
REPO_PATHS = ("deploy/", "pipelines/", "images/", "docs/", "components/")


def commands(path: Path) -> list[list[str]]:
    """The doc's shell commands as token lists: continuations joined, comments dropped, each line
    split at pipes and `;`/`&&`, `$(` and shell keywords kept off the front. Leading `VAR=value`
    assignments stay in front of the command (`make` takes them as its variables)."""
    found = []
    for block in BASH.findall(path.read_text(encoding="utf-8")):
        for line in block.replace("\\\n", " ").splitlines():
            try:
                tokens = shlex.split(line, comments=True)
            except ValueError:  # a quoted Python program spread over lines: not a command of ours
                continue
            current: list[str] = []
            for token in tokens + [";"]:
                if token in ENDS or token.endswith(";"):
                    if token.endswith(";") and token != ";":
                        current.append(token[:-1])
                    if [t for t in current if not ASSIGNMENT.match(t)]:
                        found.append(current)
                    current = []
                    continue
                if not [t for t in current if not ASSIGNMENT.match(t)]:  # still before the command itself
                    token = token.split("$(", 1)[-1]
                    if token in ("until", "while", "do", "then", "!", ""):
                        continue
                current.append(token)
    return found


def command_of(tokens: list[str]) -> tuple[list[str], list[str]]:
    """(the leading VAR=value assignments, the command)."""
    lead = 0
    while lead < len(tokens) and ASSIGNMENT.match(tokens[lead]):
        lead += 1
    return tokens[:lead], tokens[lead:]


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def flags(tokens: list[str]) -> list[str]:
    """The option names among the tokens: `--x`, `--x=v`, `-x`, `[-x]`, not `-` alone or numbers."""
    out = []
    for token in tokens:
        token = token.strip("[]")
        if re.match(r"^--?[A-Za-z]", token):
            out.append(token.split("=", 1)[0])
    return out


@functools.lru_cache(maxsize=1)
def cli_parser() -> argparse.ArgumentParser:
    return build_parser()


def check_elastic_step(tokens: list[str]) -> list[str]:
    parser, path, rest = cli_parser(), ["elastic-step"], tokens[1:]
    while rest and subparsers(parser):
        if rest[0] not in subparsers(parser):
            return [f"{' '.join(path)}: no subcommand {rest[0]!r}"]
        parser = subparsers(parser)[rest[0]]
        path.append(rest.pop(0))
    known = set(parser._option_string_actions)
    return [f"{' '.join(path)}: no flag {flag}" for flag in flags(rest) if flag not in known]


def is_elastic_step(tokens: list[str]) -> bool:
    return os.path.basename(tokens[0]) == "elastic-step" or tokens[:3] == [".venv/bin/python", "-m", "elastic_step.cli"]


def compile_help(monkeypatch, capsys) -> str:
    """`python -m elastic_step.pipelines.compile --help`, in this process (its parser is built in main)."""
    from elastic_step.pipelines import compile as compile_program

    monkeypatch.setattr(sys, "argv", ["compile", "--help"])
    with pytest.raises(SystemExit) as exited:
        compile_program.main()
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_every_documented_command_names_flags_targets_and_files_that_exist(monkeypatch, capsys):
    problems, compile_flags, make_runs, seen = [], set(), set(), {"elastic-step": 0, "compile": 0, "make": 0}
    for doc in DOCS:
        where = doc.relative_to(ROOT)
        for assignments, tokens in map(command_of, commands(doc)):
            if is_elastic_step(tokens):
                seen["elastic-step"] += 1
                start = 3 if tokens[0].endswith("python") else 1
                problems += [f"{where}: {p}" for p in check_elastic_step(["elastic-step", *tokens[start:]])]
            elif tokens[:3] == [".venv/bin/python", "-m", "elastic_step.pipelines.compile"]:
                seen["compile"] += 1
                compile_flags.update(flags(tokens[3:]))
            elif tokens[0] == "make":
                seen["make"] += 1
                make_runs.add(tuple(tokens[1:] + assignments))
            elif tokens[0] == ".venv/bin/kfp" and not (ROOT / ".venv" / "bin" / "kfp").exists():
                problems.append(f"{where}: .venv/bin/kfp is not installed by `make install`")
            problems += [f"{where}: {t} does not exist" for t in tokens
                         if t.startswith(REPO_PATHS) and not (ROOT / t.split(":", 1)[0]).exists()]
    assert all(seen.values()), seen  # not vacuous: each kind is in the docs
    helped = compile_help(monkeypatch, capsys)
    problems += [f"elastic_step.pipelines.compile: no flag {f}" for f in sorted(compile_flags)
                 if not re.search(rf"(^|[\s,]){re.escape(f)}\b", helped)]
    for args in sorted(make_runs):
        done = subprocess.run(["make", "-n", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            problems.append(f"make {' '.join(args)}: {done.stderr.strip().splitlines()[-1:]}")
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("line, problem", [
    ("elastic-step argo render --pipelin all", "elastic-step argo render: no flag --pipelin"),
    ("elastic-step trian --workers 2", "elastic-step: no subcommand 'trian'"),
    ("RUN=$(elastic-step get jobs/x --bogus | python -c 'print(1)')", "elastic-step get: no flag --bogus"),
])
def test_the_check_catches_a_renamed_flag_or_subcommand(tmp_path, line, problem):
    doc = tmp_path / "doc.md"
    doc.write_text(f"```bash\n{line}\n```\n")
    (tokens,) = [command_of(t)[1] for t in commands(doc) if is_elastic_step(command_of(t)[1])]
    assert check_elastic_step(tokens) == [problem]
