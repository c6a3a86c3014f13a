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
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..engine.timing import TimeModel
from ..workload.traces import MOONCAKE_BLOCK

__all__ = [
    "late_needed",
    "slo_already_missed",
    "StopRule",
    "replay_candidate",
    "max_prefix_hits",
    "prefill_floor_s",
    "certainly_late",
    "Floors",
    "P99",
]

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
    known: Optional[np.ndarray] = None,
) -> Dict[str, Any]:
    """Replay one candidate (``engine`` = (bill, cfg, tm); ``prefill`` > 0: ``prefill`` of the
    ``replicas`` form the prefill pool of a disaggregated cluster) and return its summary, or
    ``{"stopped": True, "arrived_share": ..., "rejected": ...}`` when the stop rule ended it.
    ``known``: :func:`certainly_late` of this time model, counted late from the start."""
    from ..cluster.cluster import Cluster, ReplayStopped

    bill, cfg, tm = engine
    if prefill:
        from ..cluster.disagg import DisaggStopped, simulate_disagg

        try:
            res = simulate_disagg(workload, cfg, tm, prefill, replicas - prefill,
                                  bill.kv_bytes_per_token, link_gb_s, router, progress=progress,
                                  slo=(ttft_s, tpot_s) if stop else None,
                                  known=known if stop else None)  # fmt: skip
        except DisaggStopped as e:
            return {"stopped": True, "arrived_share": e.arrived_share, "rejected": e.rejected,
                    "why": e.why, "pool": e.pool}  # fmt: skip
        return res.summary
    cl = Cluster(workload, cfg, tm, replicas, router)
    rule = StopRule(ttft_s, tpot_s, known=known) if stop else None
    try:
        return cl.run(progress, rule).summary
    except ReplayStopped as e:
        rej = sum(int(x.rec.rejected.sum()) for x in cl.engines)
        return {"stopped": True, "arrived_share": e.arrived / len(workload), "rejected": rej,
                "why": rule.why if rule is not None else ""}  # fmt: skip


# ---------------------------------------------------------------- the floor under every TTFT


def max_prefix_hits(workload: Any, block_size: int) -> Optional[np.ndarray]:
    """Per request, the most prompt tokens a prefix cache can ever serve it: its longest
    common prefix with any *other* request's prompt, in whole blocks, at most ``prompt - 1``
    (a cache holds only what some sequence computed, and ``BlockManager.add`` computes at
    least one token). Mooncake traces (hash ids: equal ids are equal 512-token blocks, other
    content differs up to hash collisions, the premise of any prefix cache) and length-only
    traces (every prompt unique) have it; None for the built-in workload, whose later turns
    quote earlier generated replies."""
    reqs = workload.requests
    if any(r.hash_ids is None and r.segments is not None for r in reqs):
        return None
    out = np.zeros(len(reqs), dtype=np.int64)
    # a trie of hash-id prefixes: node -> how many requests pass through it
    child: Dict[Tuple[int, int], int] = {}
    count: List[int] = [0]
    paths: List[List[int]] = []
    for r in reqs:
        node, path = 0, []
        for h in r.hash_ids or ():
            nxt = child.get((node, h))
            if nxt is None:
                nxt = child[(node, h)] = len(count)
                count.append(0)
            count[nxt] += 1
            path.append(nxt)
            node = nxt
        paths.append(path)
    for k, (r, path) in enumerate(zip(reqs, paths)):
        shared = 0
        for depth, node in enumerate(path):
            if count[node] < 2:
                break
            shared = depth + 1
        tokens = min(shared * MOONCAKE_BLOCK, r.prompt_len - 1)
        out[k] = max(0, tokens) // block_size * block_size
    return out


def prefill_floor_s(tm: Any, prompt_len: int, hit: int, budget: int) -> float:
    """A lower bound on the seconds of engine steps a prompt's first token needs when at most
    ``hit`` of its tokens come from the cache: the rest, ``L`` tokens, take at least
    ``k = ceil(L / budget)`` steps, each at least the host and collective time plus the larger
    of the dense weights' read and its tokens' GEMM time, and their causal attention FLOPs
    (independent of the chunking) at the attention rate: a step shared with other work only
    lasts longer (:meth:`TimeModel.step`)."""
    n = prompt_len - hit
    if n <= 0:
        return 0.0
    k = -(-n // budget)
    per_tok = tm.prefill_s_per_token or tm.flops_per_token / tm.gemm_flops_per_s
    read = tm.dense_bytes / tm.mem_bytes_per_s
    pairs, _ = tm.prefill_attention([(hit, n)])
    return (k * (tm.host_s + tm.comm_s_per_step) + max(k * read, n * per_tok)
            + pairs * tm.prefill_pair_flops / tm.attn_flops_per_s)  # fmt: skip


def certainly_late(
    workload: Any, tm: Any, budget: int, block_size: int, target_s: float,
    hits: Optional[np.ndarray] = None,
) -> Optional[np.ndarray]:  # fmt: skip
    """Per request, whether its TTFT exceeds ``target_s`` on any replica of this time model
    and token budget, at any load (:func:`prefill_floor_s` of its uncached part, with a
    1e-9 relative margin for rounding); None where :func:`max_prefix_hits` has no bound."""
    if type(tm) is not TimeModel:  # a subclass may price prefill otherwise (KVArrivalTime)
        return None
    if hits is None:
        hits = max_prefix_hits(workload, block_size)
    if hits is None:
        return None
    out = np.zeros(len(workload.requests), dtype=bool)
    for k, r in enumerate(workload.requests):
        out[k] = prefill_floor_s(tm, r.prompt_len, int(hits[k]), budget) * (1 - 1e-9) > target_s
    return out


class Floors:
    """The requests certainly over the TTFT target, per time model and block size
    (:func:`certainly_late`, computed once for every family that shares them), and the reason
    a family can never meet the target when they are :func:`late_needed` or more."""

    def __init__(self, workload: Any, budget: int, ttft_s: float) -> None:
        self.workload, self.budget, self.ttft_s = workload, budget, ttft_s
        self._hits: Dict[int, Optional[np.ndarray]] = {}
        self._known: Dict[Any, Optional[np.ndarray]] = {}

    def known(self, engine: Any) -> Optional[np.ndarray]:
        """For a family's ``(bill, cfg, tm)``."""
        _, cfg, tm = engine
        bs = cfg.block_size
        if bs not in self._hits:
            self._hits[bs] = max_prefix_hits(self.workload, bs)
        if (tm, bs) not in self._known:
            self._known[(tm, bs)] = certainly_late(self.workload, tm, self.budget, bs,
                                                   self.ttft_s, self._hits[bs])  # fmt: skip
        return self._known[(tm, bs)]

    def reason(self, engine: Any) -> str:
        """Why no replica count of this family can meet the target, or ``""``."""
        from ..report.simulation import _secs

        k = self.known(engine)
        n = int(k.sum()) if k is not None else 0
        need = late_needed(len(self.workload))
        if n < need:
            return ""
        return (f"TTFT p99 > {_secs(self.ttft_s)} at any replica count: {n:,} requests' uncached "
                f"prefill alone takes longer on an idle replica (p99 needs {need:,}); not replayed")  # fmt: skip
