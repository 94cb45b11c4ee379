"""`elastic-step`: prepare data, train elastically, watch and scale a job, and the pipeline
steps (evaluate, export, promote) for runners other than KFP.

Each command group lives in its own module with a `register(subparsers)` that adds its parsers
and sets `func`; this module only assembles them and turns engine errors into one-line causes.
"""

from __future__ import annotations

import argparse
import logging
import sys

from elastic_step.cli import argo, data, jobs, logs, observe, release, schedule, submit, train
from elastic_step.errors import ElasticStepError

COMMAND_MODULES = (data, train, submit, jobs, observe, logs, release, argo, schedule)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elastic-step", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the master does")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMAND_MODULES:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ElasticStepError as exc:
        # An exit code of 0 is an end that is no error (a job stopped by its operator).
        print(f"elastic-step {args.command}: {'' if exc.exit_code == 0 else 'error: '}{exc}", file=sys.stderr)
        return exc.exit_code
