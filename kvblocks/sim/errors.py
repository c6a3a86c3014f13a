"""Errors raised by the simulator and the planner.

They derive from :class:`kvblocks.InvalidArgumentError` (so from ``KVBlocksError`` and
``ValueError``); the command line turns each into one ``kvblocks: error: ...`` line.
"""

from __future__ import annotations

from typing import Optional

from ..errors import InvalidArgumentError

__all__ = ["SimulationError", "WorkloadError"]


class SimulationError(InvalidArgumentError):
    """A simulation or plan cannot run as asked (bad model, memory that does not fit...)."""


class WorkloadError(SimulationError):
    """A workload file is missing or malformed; names the file and, when known, the line."""

    def __init__(self, message: str, path: Optional[str] = None, line: Optional[int] = None):
        self.path = path
        self.line = line
        self.reason = message
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(where + message)
