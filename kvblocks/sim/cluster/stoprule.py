"""When a replay in progress can no longer meet a p99 target: the planner's stop rule.

The report's p99 is numpy's default (linear) percentile over the finite values: with ``n`` of
them sorted ascending, ``v[k] + g (v[k+1] - v[k])`` where ``h = (n - 1) x 0.99``, ``k =
floor(h)``, ``g = h - k`` in [0, 1). So p99 >= ``v[k]``, and p99 > T as soon as ``n - k``
values exceed T (:func:`late_needed`). A request's TTFT is known to exceed T before it is over:
once it got its first token late, or while it still waits for it ``now - arrival > T`` on its
engine's clock (clocks only move forward); TPOT likewise (finished over the target, or still
decoding ``(now - first token) / (tokens - 1) > T``). :func:`slo_already_missed` counts both;
it never stops a replay whose p99 would meet the target, since every request it counts ends over
the target. :class:`StopRule` is the ``stop`` callback :meth:`Cluster.run` takes
(:mod:`kvblocks.sim.plan.replays` uses it for every planner replay, disaggregated ones too).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

__all__ = ["P99", "late_needed", "slo_already_missed", "StopRule"]

P99 = 99.0  # the percentile the report's ``*_p99`` keys use (numpy's default, linear, method)


def late_needed(n: int) -> int:
    """How many of ``n`` values over a target make their p99 (as the report computes it) exceed
    it for certain: ``n - floor((n - 1) x 0.99)``, the same floating-point index as numpy's."""
    if n <= 0:
        return 1
    return n - int(math.floor((n - 1) * (P99 / 100)))


def _late_counts(
    e: Any,
    ttft_s: float,
    tpot_s: Optional[float],
    arrival: Optional[np.ndarray],
    known: Optional[np.ndarray],
) -> "tuple[int, int]":
    """Requests of engine ``e`` certainly over the TTFT (those not in ``known``, counted
    apart) and the TPOT target."""
    rec = e.rec
    arr = rec.arrival if arrival is None else arrival
    ft = rec.first_token
    got = np.isfinite(ft)
    over = got & (ft - np.where(got, arr, 0.0) > ttft_s)
    if known is not None:
        over &= ~known
    late = int(np.count_nonzero(over))
    now = e.now
    for q in (e.waiting, e.running, e.swapped):
        for x in q:
            i = x.req.index
            if x.sample == 0 and not got[i] and now - arr[i] > ttft_s:
                if known is None or not known[i]:
                    late += 1
    slow = 0
    if tpot_s is not None:
        per = rec.output_tokens // np.maximum(rec.samples, 1)
        fin = rec.finish
        multi = got & (per > 1)
        done = multi & np.isfinite(fin)
        with np.errstate(invalid="ignore"):
            slow += int(np.count_nonzero((fin[done] - ft[done]) / (per[done] - 1) > tpot_s))
            going = multi & ~np.isfinite(fin)
            slow += int(np.count_nonzero((now - ft[going]) / (per[going] - 1) > tpot_s))
    return late, slow


def slo_already_missed(
    cluster: Any,
    ttft_s: float,
    tpot_s: Optional[float] = None,
    arrival: Optional[np.ndarray] = None,
    known: Optional[np.ndarray] = None,
) -> str:
    """Why a cluster replay in progress can no longer meet TTFT p99 <= ``ttft_s`` (and TPOT
    p99 <= ``tpot_s``), or ``""`` while it still can: ``"rejected"`` (a request was), ``"ttft"``
    or ``"tpot"`` (:func:`late_needed` requests are already certainly over that target).
    ``arrival`` (per request of the cluster's workload) overrides the arrival times the TTFT
    counts from (a disaggregated decode pool's, which are the ends of the prefills); ``known``
    (bool per request, :func:`certainly_late`) marks requests over the TTFT target whatever
    happens, counted from the start."""
    need = late_needed(len(cluster.workload))
    late = int(np.count_nonzero(known)) if known is not None else 0
    slow = 0
    for e in cluster.engines:
        if e.rec.rejected.any():
            return "rejected"
        a, b = _late_counts(e, ttft_s, tpot_s, arrival, known)
        late += a
        slow += b
    return "ttft" if late >= need else "tpot" if slow >= need else ""


class StopRule:
    """A replay's ``stop`` callback (:meth:`Cluster.run`): :func:`slo_already_missed`, with
    the reason kept in ``why``."""

    def __init__(
        self,
        ttft_s: float,
        tpot_s: Optional[float] = None,
        arrival: Optional[np.ndarray] = None,
        known: Optional[np.ndarray] = None,
    ) -> None:
        self.ttft_s, self.tpot_s, self.arrival, self.known = ttft_s, tpot_s, arrival, known
        self.why = ""

    def __call__(self, cluster: Any) -> bool:
        self.why = slo_already_missed(cluster, self.ttft_s, self.tpot_s, self.arrival,
                                      self.known)  # fmt: skip
        return bool(self.why)
