"""Progress of a long replay: the callback type, its throttle, and a dependency-free bar."""

from __future__ import annotations

import sys
import time
from typing import Callable, Optional, TextIO

__all__ = ["Progress", "ProgressThrottle", "ProgressBar"]

Progress = Callable[[int, float], None]
"""``progress(requests_done, simulated_seconds)``, called now and then during a replay."""


class ProgressThrottle:
    """Passes a replay's progress on every ``every`` steps, at most every ``interval_s`` of wall
    time, and once more at the end (:meth:`close`), so a fast replay is not slowed by drawing."""

    __slots__ = ("progress", "every", "interval_s", "last", "next_at")

    def __init__(self, progress: Progress, every: int = 256, interval_s: float = 0.2) -> None:
        self.progress = progress
        self.every = every
        self.interval_s = interval_s
        self.last = time.perf_counter()
        self.next_at = every  # the step count that looks at the clock next

    def step(self, steps: int, done: int, now: float) -> None:
        """After a step (or several in a row): ``steps`` so far, ``done`` requests finished,
        simulated time ``now``."""
        if steps >= self.next_at:
            self.next_at = steps - steps % self.every + self.every
            w = time.perf_counter()
            if w - self.last > self.interval_s:
                self.last = w
                self.progress(done, now)

    def close(self, done: int, now: float) -> None:
        self.progress(done, now)


class ProgressBar:
    """``label [#####.....] 45% 5,412/12,031 requests  sim 1,234 s  3.2 s`` redrawn in place."""

    def __init__(
        self, label: str, total: int, stream: Optional[TextIO] = None, width: int = 30
    ) -> None:
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
