"""The one replay loop: a workload's arrivals handed to an engine in order, idle gaps jumped,
steps run until everything is done.

Both engines take this shape: :class:`~kvblocks.sim.engine.paged.PagedEngine` (the real
allocator) and :class:`~kvblocks.sim.engine.contiguous.ContiguousEngine` (max-length
reservation). An :class:`Engine` has a clock ``now``, counts ``steps`` and finished requests,
says when it is ``idle``, takes arrivals (``submit``) and runs one step at a time (``step``).
Before each step the loop sets ``horizon``, the next arrival (infinity when none is left), so
that an engine which fast-forwards over steps stops there; a paged engine also gets ``feed``,
which queues the arrivals up to a time, so that decode-only steps behind a queue whose head
cannot be admitted go on past arrivals (they only join the tail). The
cluster (:mod:`kvblocks.sim.cluster.cluster`) drives several paged engines through the same
calls under one clock.
"""

from __future__ import annotations

import math
from typing import Optional, Protocol, Sequence

from ..workload.traces import Request
from .progress import Progress, ProgressThrottle

__all__ = ["Engine", "replay"]


class Engine(Protocol):
    """What :func:`replay` drives."""

    now: float  # simulated seconds
    steps: int  # engine steps run (a fast-forward counts each step it covers)
    finished_reqs: int  # requests done or rejected
    horizon: float  # the next arrival, set by the loop before each step

    @property
    def idle(self) -> bool: ...

    def submit(self, req: Request) -> None: ...

    def step(self) -> float: ...


def replay(engine: Engine, reqs: Sequence[Request], progress: Optional[Progress] = None) -> None:
    """Hand ``reqs`` (in arrival order) to ``engine`` as its clock reaches them and step it until
    it is idle with nothing left to arrive; progress reports after every step."""
    n_req = len(reqs)
    nxt = 0
    tick = ProgressThrottle(progress) if progress is not None else None

    def feed(t: float) -> float:
        """Queue the arrivals up to ``t`` (as the loop below would before the next step);
        returns the next arrival's time."""
        nonlocal nxt
        while nxt < n_req and reqs[nxt].arrival <= t:
            engine.submit(reqs[nxt])
            nxt += 1
        return reqs[nxt].arrival if nxt < n_req else math.inf

    if hasattr(engine, "feed"):
        engine.feed = feed  # a paged engine: decode-only runs go on past arrivals
    while True:
        while nxt < n_req and reqs[nxt].arrival <= engine.now:
            engine.submit(reqs[nxt])
            nxt += 1
        if engine.idle:
            if nxt >= n_req:
                break
            engine.now = reqs[nxt].arrival
            continue
        engine.horizon = reqs[nxt].arrival if nxt < n_req else math.inf
        engine.step()
        if tick is not None:
            tick.step(engine.steps, engine.finished_reqs, engine.now)
    if tick is not None:
        tick.close(engine.finished_reqs, engine.now)
