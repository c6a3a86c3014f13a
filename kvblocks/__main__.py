"""``python -m kvblocks`` and the ``kvblocks`` console script: see :mod:`kvblocks.sim.cli`."""

from __future__ import annotations

import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    """Run the ``kvblocks`` command line; returns the exit status."""
    from .sim.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
