"""The one ``kvblocks`` command line (console script and ``python -m kvblocks``).

It builds the parser, lets each package add its subcommands and dispatches to them:
``simulate`` and ``plan`` (:mod:`kvblocks.sim.cli`), ``bench`` (:mod:`kvblocks.bench.cli`),
``config`` (:mod:`kvblocks.clib`: the C library's compiler flags).
Every error a user can cause prints one ``kvblocks: error: ...`` line and exits with status 2,
without a traceback: argparse's refusals here, the library's :class:`KVBlocksError` raised by a
subcommand (which checks its inputs before starting any long work).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, NoReturn, Optional

__all__ = ["main", "build_parser"]


class _UsageError(Exception):
    """A command line argparse refused; main prints it as one line and returns 2."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage dump, no SystemExit from main)."""

    def error(self, message: str) -> NoReturn:
        if message.endswith("expected one argument"):  # argparse takes "-inf" or "-1e5" for a flag
            message += " (write --flag=VALUE for a value starting with '-')"
        elif not message.startswith("argument "):  # unknown or missing flags
            message += f" (see '{self.prog} --help')"
        raise _UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``kvblocks`` (its subcommands' parsers share its class)."""
    from . import clib
    from .bench import cli as bench_cli
    from .sim import cli as sim_cli

    parser = _Parser(prog="kvblocks", description="kvblocks: paged KV-cache memory manager tools.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sim_cli.add_commands(sub)
    bench_cli.add_command(sub)
    clib.add_command(sub)
    return parser


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "bench":
        from .bench.cli import run
    elif args.command == "config":
        from .clib import run
    else:
        from .sim.cli import run
    return run(args)


def main(argv: Optional[List[str]] = None) -> int:
    """Run the ``kvblocks`` command line; returns the exit status."""
    from .errors import KVBlocksError

    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # named with the subcommand's help, which lists its flags
            prog = f"kvblocks {args.command}" if args.command else "kvblocks"
            raise _UsageError(f"unrecognized arguments: {' '.join(extra)} (see '{prog} --help')")
    except _UsageError as e:
        print(f"kvblocks: error: {e}", file=sys.stderr)
        return 2
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return _dispatch(args)
    except KVBlocksError as e:
        print(f"kvblocks: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvblocks: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0


if __name__ == "__main__":
    sys.exit(main())
