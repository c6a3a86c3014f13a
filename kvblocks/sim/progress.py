"""A dependency-free progress bar on stderr for long replays."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """``label [#####.....] 45% 5,412/12,031 requests  sim 1,234 s  3.2 s`` redrawn in place."""

    def __init__(self, label: str, total: int, stream: Optional[TextIO] = None, width: int = 30) -> None:
        self.label = label
        self.total = max(1, total)
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.t0 = time.perf_counter()
        self._shown = False

    def __call__(self, done: int, sim_time: float) -> None:
        frac = min(1.0, done / self.total)
        fill = int(frac * self.width)
        line = (
            f"\r{self.label} [{'#' * fill}{'.' * (self.width - fill)}] {frac:4.0%} "
            f"{done:,}/{self.total:,} requests  sim {sim_time:,.0f} s  {time.perf_counter() - self.t0:.1f} s"
        )
        self.stream.write(line)
        self.stream.flush()
        self._shown = True

    def close(self) -> None:
        if self._shown:
            self.stream.write("\n")
            self.stream.flush()
