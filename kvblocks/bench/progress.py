"""A dependency-free progress bar on stderr for the longer suites."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """``bench alloc [#########.........] 45% 12/27  3.2 s`` redrawn in place; call with
    ``(done, total)``, then :meth:`close`. Redraws at most every 50 ms."""

    def __init__(self, label: str, stream: Optional[TextIO] = None, width: int = 28) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.t0 = time.perf_counter()
        self._last = 0.0
        self._shown = False

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if done < total and now - self._last < 0.05:
            return
        self._last = now
        frac = min(1.0, done / max(1, total))
        fill = int(frac * self.width)
        self.stream.write(
            f"\r{self.label} [{'#' * fill}{'.' * (self.width - fill)}] {frac:4.0%} "
            f"{done}/{total}  {now - self.t0:.1f} s"
        )
        self.stream.flush()
        self._shown = True

    def close(self) -> None:
        if self._shown:
            self.stream.write("\n")
            self.stream.flush()
            self._shown = False
