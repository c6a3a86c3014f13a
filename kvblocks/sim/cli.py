"""The ``kvblocks simulate`` and ``kvblocks plan`` subcommands (dispatched by kvblocks/__main__.py).

Every error the user can cause (a flag out of range, missing or malformed file, bad lengths,
unknown model, memory that does not fit) prints one ``kvblocks: error: ...`` line and exits with
status 2; no traceback. Every numeric flag is parsed by its :class:`~kvblocks.sim.limits.Limit`
(an argparse ``type=``), so NaN, infinities and out-of-range values stop the parse itself.
"""

from __future__ import annotations

import argparse

from . import simulate
from .plan import cli as plan_cli

__all__ = ["add_commands", "run"]


def add_commands(sub: "argparse._SubParsersAction") -> None:
    """Add ``simulate`` and ``plan`` to the subcommands of the ``kvblocks`` parser (each built
    next to its code: :mod:`kvblocks.sim.simulate`, :mod:`kvblocks.sim.plan.cli`)."""
    simulate.add_parser(sub)
    plan_cli.add_parser(sub)


def run(args: argparse.Namespace) -> int:
    """Run the parsed ``simulate`` or ``plan`` command; returns the exit status."""
    return simulate.run(args) if args.command == "simulate" else plan_cli.plan_command(args)
