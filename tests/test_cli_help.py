"""The CLI's surface: every flag of every command says what it does in --help, and every
--backend offers its choices."""

from __future__ import annotations

import argparse

from elastic_step.cli import build_parser


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("elastic-step",)):
    """(command path, parser) for the program and every subcommand, nested ones included."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))


def test_every_flag_has_help_text():
    missing = [f"{' '.join(path)} {'/'.join(a.option_strings) or a.dest}"
               for path, parser in commands(build_parser()) for a in parser._actions
               if not isinstance(a, argparse._SubParsersAction) and not a.help]
    assert not missing, f"flags without help: {missing}"


def test_every_backend_flag_offers_its_choices():
    backends = [(path, a) for path, parser in commands(build_parser()) for a in parser._actions if a.dest == "backend"]
    assert len(backends) > 5  # train, get, list, stop, logs, ...
    assert all(a.choices and set(a.choices) <= {"local", "kubernetes"} for _, a in backends), backends
