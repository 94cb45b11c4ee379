"""Text from a worker or a pod, made safe to print on a terminal. A worker's exit reason, its log
lines and its error messages are the worker's own text (and so, the model definition's): a
control character there would reach the operator's terminal raw, where `ESC ] 0 ; ...` retitles
the window and `ESC [ 2 J` clears it. Every C0 and C1 control character, and DEL, is shown as
its escape instead (`\\x1b`); a tab and a line break stay what they are."""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` with its control characters (but tab and newline) written as `\\xNN`."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
