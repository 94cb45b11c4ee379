"""`elastic-step`: prepare data, train elastically, watch and scale a job, and the pipeline
steps (evaluate, export, promote) for runners other than KFP.

Each command group lives in its own module with a `register(subparsers)` that adds its parsers
and sets `func`; this module only assembles them and turns engine errors into one-line causes.
"""

from __future__ import annotations

import argparse
import logging
import sys

from elastic_step.cli import argo, data, jobs, logs, observe, release, schedule, serve, submit, train
from elastic_step.defaults import LOG_FORMAT
from elastic_step.errors import ElasticStepError
from elastic_step.exit_codes import ExitCode

COMMAND_MODULES = (data, train, submit, jobs, observe, logs, release, serve, argo, schedule)
# A job's processes: when they run as a program (`elastic-step ...`, `python -m elastic_step.cli ...`,
# so main reads sys.argv) they have saved, recorded and flushed all they own by the time their
# command returns, and skip the interpreter's teardown of torch's, MLflow's and pyarrow's modules
# (seconds on a busy node, and a master waits for its workers' exits).
# prepare-data too: after a failed read, pyarrow's background reader thread can still hold the
# source's Python file object; the interpreter's teardown then stops that thread inside C++ and the
# process aborts (SIGABRT, "terminate called without an active exception") instead of exiting 2.
EXIT_WITHOUT_TEARDOWN = ("train", "worker", "prepare-data")


def build_parser() -> argparse.ArgumentParser:
    from elastic_step import __version__

    parser = argparse.ArgumentParser(prog="elastic-step", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the master does")
    parser.add_argument("--version", action="version", version=f"elastic-step {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format=LOG_FORMAT)
    try:
        code = args.func(args)
        if argv is None and args.command in EXIT_WITHOUT_TEARDOWN:
            exit_now(code)
        return code
    except ElasticStepError as exc:
        # Exit codes are elastic_step.exit_codes'; a stop or a preemption is an end, not an error.
        is_error = exc.exit_code not in (ExitCode.SUCCESS, ExitCode.PREEMPTED)
        print(f"elastic-step {args.command}: {'error: ' if is_error else ''}{exc}", file=sys.stderr)
        if exc.exit_code == ExitCode.PREEMPTED or (argv is None and args.command in EXIT_WITHOUT_TEARDOWN):
            exit_now(exc.exit_code)
        return int(exc.exit_code)


def exit_now(code: int) -> None:
    """Exit at once (within a preemption's grace period; a job process that has ended): everything
    the job had to save is saved, and the interpreter's own teardown of torch's, MLflow's and pyarrow's modules (seconds on a busy node)
    is skipped. Logs and the console are flushed first."""
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))
