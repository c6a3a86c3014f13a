"""One planner replay: a candidate configuration replayed on the trace, stopped as soon as its
verdict is certain.

**When a p99 target is certainly missed.** The report's p99 is numpy's default (linear)
percentile over the finite values: with ``n`` of them sorted ascending, ``v[k] + g (v[k+1] -
v[k])`` where ``h = (n - 1) x 0.99``, ``k = floor(h)``, ``g = h - k`` in [0, 1). So p99 >=
``v[k]``, and p99 > T as soon as ``n - k`` values exceed T (:func:`late_needed`; for the
12,031-request conversation trace, 122 requests: 1.01%). A replay's TTFT values are all
finite at its end unless a request was rejected (which misses the plan's SLO anyway), so
``n`` is the workload's size. A request's TTFT is known to exceed T before it is over: once
it got its first token late, or while it still waits for it ``now - arrival > T`` on its
engine's clock (clocks only move forward). TPOT (``(finish - first token) / (tokens - 1)``
per request, 0 for one-token outputs) likewise: once finished over the target, or while it
still decodes ``(now - first token) / (tokens - 1) > T``. :func:`slo_already_missed` counts
both; it never stops a replay whose p99 would meet the target, since every request it counts
ends over the target.

:func:`replay_candidate` runs one candidate, aggregated (:class:`~kvblocks.sim.cluster.cluster.Cluster`)
or disaggregated (:func:`~kvblocks.sim.cluster.disagg.simulate_disagg`), with that stop rule
(``stop=False``: to the end, as an exhaustive search would).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import numpy as np

__all__ = ["late_needed", "slo_already_missed", "StopRule", "replay_candidate", "P99"]

P99 = 99.0  # the percentile the report's ``*_p99`` keys use (numpy's default, linear, method)


def late_needed(n: int) -> int:
    """How many of ``n`` values over a target make their p99 (as the report computes it) exceed
    it for certain: ``n - floor((n - 1) x 0.99)``, the same floating-point index as numpy's."""
    if n <= 0:
        return 1
    return n - int(math.floor((n - 1) * (P99 / 100)))


def _late_counts(
    e: Any, ttft_s: float, tpot_s: Optional[float], arrival: Optional[np.ndarray]
) -> "tuple[int, int]":
    """Requests of engine ``e`` certainly over the TTFT (and TPOT) target."""
    rec = e.rec
    arr = rec.arrival if arrival is None else arrival
    ft = rec.first_token
    got = np.isfinite(ft)
    late = int(np.count_nonzero(ft[got] - arr[got] > ttft_s))
    now = e.now
    for q in (e.waiting, e.running, e.swapped):
        for x in q:
            i = x.req.index
            if x.sample == 0 and not got[i] and now - arr[i] > ttft_s:
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
) -> str:
    """Why a cluster replay in progress can no longer meet TTFT p99 <= ``ttft_s`` (and TPOT
    p99 <= ``tpot_s``), or ``""`` while it still can: ``"rejected"`` (a request was), ``"ttft"``
    or ``"tpot"`` (:func:`late_needed` requests are already certainly over that target).
    ``arrival`` (per request of the cluster's workload) overrides the arrival times the TTFT
    counts from (a disaggregated decode pool's, which are the ends of the prefills)."""
    need = late_needed(len(cluster.workload))
    late = slow = 0
    for e in cluster.engines:
        if e.rec.rejected.any():
            return "rejected"
        a, b = _late_counts(e, ttft_s, tpot_s, arrival)
        late += a
        slow += b
    return "ttft" if late >= need else "tpot" if slow >= need else ""


class StopRule:
    """A replay's ``stop`` callback (:meth:`Cluster.run`): :func:`slo_already_missed`, with
    the reason kept in ``why``."""

    def __init__(
        self, ttft_s: float, tpot_s: Optional[float] = None, arrival: Optional[np.ndarray] = None
    ) -> None:
        self.ttft_s, self.tpot_s, self.arrival = ttft_s, tpot_s, arrival
        self.why = ""

    def __call__(self, cluster: Any) -> bool:
        self.why = slo_already_missed(cluster, self.ttft_s, self.tpot_s, self.arrival)
        return bool(self.why)


def replay_candidate(
    workload: Any,
    engine: Any,
    replicas: int,
    prefill: int,
    router: str,
    ttft_s: float,
    tpot_s: Optional[float],
    link_gb_s: float,
    stop: bool = True,
    progress: Any = None,
) -> Dict[str, Any]:
    """Replay one candidate (``engine`` = (bill, cfg, tm); ``prefill`` > 0: ``prefill`` of the
    ``replicas`` form the prefill pool of a disaggregated cluster) and return its summary, or
    ``{"stopped": True, "arrived_share": ..., "rejected": ...}`` when the stop rule ended it."""
    from ..cluster.cluster import Cluster, ReplayStopped

    bill, cfg, tm = engine
    if prefill:
        from ..cluster.disagg import DisaggStopped, simulate_disagg

        try:
            res = simulate_disagg(workload, cfg, tm, prefill, replicas - prefill,
                                  bill.kv_bytes_per_token, link_gb_s, router, progress=progress,
                                  slo=(ttft_s, tpot_s) if stop else None)  # fmt: skip
        except DisaggStopped as e:
            return {"stopped": True, "arrived_share": e.arrived_share, "rejected": e.rejected,
                    "why": e.why, "pool": e.pool}  # fmt: skip
        return res.summary
    cl = Cluster(workload, cfg, tm, replicas, router)
    rule = StopRule(ttft_s, tpot_s) if stop else None
    try:
        return cl.run(progress, rule).summary
    except ReplayStopped as e:
        rej = sum(int(x.rec.rejected.sum()) for x in cl.engines)
        return {"stopped": True, "arrived_share": e.arrived / len(workload), "rejected": rej,
                "why": rule.why if rule is not None else ""}  # fmt: skip
