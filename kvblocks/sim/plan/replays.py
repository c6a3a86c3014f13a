"""One planner replay: a candidate configuration replayed on the trace, stopped as soon as its
verdict is certain.

**When a p99 target is certainly missed**: :mod:`kvblocks.sim.cluster.stoprule` (the report's
linear p99 exceeds T once ``n - floor((n - 1) x 0.99)`` values do: 122 of the 12,031-request
conversation trace, 1.01%), re-exported here.

**The floor under every TTFT** (:func:`certainly_late`, :class:`Floors`): requests whose
uncached prefill alone takes longer than the target, on any replica count and load.

:func:`replay_candidate` runs one candidate, aggregated (:class:`~kvblocks.sim.cluster.cluster.Cluster`)
or disaggregated (:func:`~kvblocks.sim.cluster.disagg.simulate_disagg`), with that stop rule
(``stop=False``: to the end, as an exhaustive search would).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..cluster.stoprule import P99, StopRule, late_needed, slo_already_missed
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
