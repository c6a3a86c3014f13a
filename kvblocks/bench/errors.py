"""The error of ``kvblocks bench``: a request that cannot run (unknown suite, bad --compare file,
--plot without matplotlib). It derives from :class:`kvblocks.InvalidArgumentError`; the command
line prints it as one ``kvblocks: error: ...`` line and exits with status 2, before any timing.
"""

from __future__ import annotations

from ..errors import InvalidArgumentError

__all__ = ["BenchError"]


class BenchError(InvalidArgumentError):
    """A benchmark run cannot start as asked."""
