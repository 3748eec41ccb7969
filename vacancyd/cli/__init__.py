"""Command line: ``vacancyd run | check-config | status | usage | open | pause | resume |
measure | profiles export|import | init | companion | k8s mark-stale|cleanup |
install-service | remove-service | --version``.

:func:`main` is the entry point (``vacancyd = "vacancyd.cli:main"`` in pyproject.toml, and
``python -m vacancyd``). The argparse tree is in :mod:`vacancyd.cli.parser`; each command
family has its module: ``daemon`` (run, companion, check-config), ``owner`` (status, open,
pause, resume), ``install`` (init, install-service, remove-service), ``footprints`` (measure,
profiles), ``usage`` (the usage ledger) and ``k8s``; ``apiclient`` talks to a running
daemon's API and ``render`` turns a status document into text.
"""

from __future__ import annotations

import os
import sys

from vacancyd.cli.common import DEFAULT_URL
from vacancyd.cli.parser import build_parser
from vacancyd.cli.render import format_owner_controls, format_sessions, format_status

__all__ = [
    "BROKEN_PIPE_EXIT",
    "DEFAULT_URL",
    "build_parser",
    "format_owner_controls",
    "format_sessions",
    "format_status",
    "main",
]


#: Exit status when the reader of our output went away (``vacancyd status | head``), as the
#: Python documentation recommends for a closed pipe.
BROKEN_PIPE_EXIT = 1


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. Returns its exit status; a reader that closes our standard output
    early (``vacancyd status | head -1``) ends the command quietly with
    :data:`BROKEN_PIPE_EXIT`, never with a traceback."""
    try:
        try:
            args = build_parser().parse_args(argv)  # --help prints, then exits
            code: int = args.func(args)
        finally:
            sys.stdout.flush()  # a buffered tail meets the closed pipe here, not at exit
    except BrokenPipeError:
        _quiet_stdout()
        return BROKEN_PIPE_EXIT
    return code


def _quiet_stdout() -> None:
    """Point standard output at /dev/null, so that flushing it at interpreter exit does not
    hit the closed pipe again (the recipe in Python's ``signal`` documentation)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
