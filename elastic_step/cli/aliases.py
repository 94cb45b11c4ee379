"""Old spellings of renamed flags: they keep working (users' scripts must not break), are hidden
from --help, and say their new name in one line on stderr each time they are used."""

from __future__ import annotations

import argparse
import sys


class DeprecatedAlias(argparse.Action):
    """Stores into the new flag's dest, as the new flag would."""

    def __init__(self, option_strings, dest, new_flag: str, note: str = "", **kwargs):
        self.new_flag, self.note = new_flag, note
        # SUPPRESS: the new flag's default stays the one parse_args sets.
        kwargs.update(help=argparse.SUPPRESS, default=argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: {option_string} is deprecated, use {self.new_flag}{self.note}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_alias(group, old_flag: str, new_flag: str, dest: str, note: str = "", metavar: str = "NAME") -> None:
    """`old_flag` as a hidden, deprecated spelling of `new_flag` (which stores into `dest`)."""
    group.add_argument(old_flag, dest=dest, action=DeprecatedAlias, new_flag=new_flag, note=note, metavar=metavar)
