"""Cluster simulation: N engines behind one router, driven by one arrival stream.

Each replica is a :class:`~kvblocks.sim.engine.paged.PagedEngine` with its own ``BlockManager``
(the single-engine loop, reused: no second copy of it). All replicas share one hash key, as a
cluster configured with one hash seed does, so equal prompts hash alike everywhere and a router
can match them.

**Shared clock.** Every engine keeps its own simulated time and steps are discrete, so the
cluster advances them in lock-step on one clock: it always runs the step of the busy engine
that is furthest behind (ties: the lowest index), unless the next arrival comes first. A
request is routed when it arrives, from the replicas' state at that moment: their
:class:`~kvblocks.sim.cluster.routers.Load` and, for the prefix-aware router, the KV events each
engine published after each of its steps (``pool.take_events()``, applied in order). An idle
engine's clock jumps to the arrival it receives.

**Host tiers.** With ``cfg.host_cache_blocks`` every replica has its own host tier. The
prefix-aware router indexes the host pools' events too (``host_pool.take_events()``, medium
``"CPU"``), as Dynamo's router does with KVBM's CPU-tier events and llm-d's with its ``cpu``
medium: a prefix held on a replica's host counts :data:`~kvblocks.sim.cluster.prefixindex.HOST_CREDIT`
of a device block (it still costs an onload). ``index_host_events=False`` routes on device
events only, as a router that subscribes to the GPU stream alone would.

**Results.** :meth:`Cluster.run` returns a :class:`ClusterResult`: one summary per replica
(its own requests only) and the aggregate. In the aggregate, request figures (hit rate, TTFT,
queueing, latency, throughput, makespan) are over all requests, counters (evictions,
preemptions, steps, allocator time) are summed, and per-step figures are per replica: KV usage
and concurrency are the mean of the replicas' time-weighted means, their peaks the maximum.
``prefix_hit_rate`` counts prompt tokens served from any cache tier.

>>> from kvblocks.sim import SchedulerConfig, TimeModel, builtin_workload, get_model
>>> w = builtin_workload().head(40)
>>> cfg = SchedulerConfig(num_blocks=2000)
>>> tm = TimeModel.for_model(get_model("llama-3.1-8b"))
>>> res = Cluster(w, cfg, tm, replicas=2, router="round_robin").run()
>>> [r["requests"] for r in res.replicas], res.summary["completed"]
([20, 20], 40)
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from ... import hash_blocks
from .. import limits
from ..engine.batching import SchedulerConfig
from ..engine.metrics import Recorder, SimResult
from ..engine.paged import PagedEngine
from ..engine.progress import Progress, ProgressThrottle
from ..engine.timing import TimeModel
from ..errors import SimulationError
from ..workload.traces import Workload
from .routers import Load, Router, make_router, prompt_hash_array

__all__ = ["Cluster", "ClusterResult", "ReplayStopped", "simulate_cluster", "CLUSTER_HASH_KEY"]

CLUSTER_HASH_KEY = b"kvblocks-cluster"  # the hash key every replica (and the router) uses

# per-step figures: aggregated as the mean over replicas, or the max for peaks
_MEAN_KEYS = ("mean_kv_usage", "mean_concurrency", "internal_fragmentation")
_MAX_KEYS = ("peak_kv_usage", "peak_concurrency")
_SUM_KEYS = (
    "steps",
    "evictions",
    "preemptions",
    "preemptions_recompute",
    "preemptions_swap",
    "cache_lookups",
    "lookup_blocks",
    "block_hits",
    "recompute_readds",
    "recompute_cached_tokens",
    "cow_copies",
    "swapped_blocks",
    "allocator_s",
    "check_s",
    "device_hit_tokens",
    "host_hit_tokens",
    "onload_blocks",
    "offload_blocks",
    "demotion_offload_blocks",
    "write_through_offload_blocks",
    "transfer_s",
    "host_demotions",
    "host_evictions",
    "host_dropped",
)


@dataclass
class ClusterResult:
    """The aggregate summary, one summary per replica, and the router's settings."""

    summary: Dict[str, Any]
    replicas: List[Dict[str, Any]]
    router: Dict[str, Any]
    results: List[SimResult]  # each replica's own result (recorders over all request slots)

    @property
    def paged(self) -> SimResult:
        """The aggregate as a SimResult (its recorder is replica 0's, for plots)."""
        return SimResult("paged", self.summary, self.results[0].recorder)


class Cluster:
    """``replicas`` engines behind ``router``, replaying ``workload`` on a shared clock."""

    def __init__(
        self,
        workload: Workload,
        cfg: SchedulerConfig,
        tm: TimeModel,
        replicas: int,
        router: str = "round_robin",
        overlap_weight: Optional[float] = None,
        index_host_events: bool = True,
        direct_lookup: bool = True,
    ) -> None:
        n = limits.REPLICAS.check_int(replicas)
        self.router: Router = make_router(router, n, cfg.block_size, overlap_weight)
        cfg.validate()
        self.workload = workload
        self.cfg = cfg
        self.wall0 = time.perf_counter()
        events = self.router.needs_events
        # One group and no host tier: the index a router builds from every KV event of a pool
        # is exactly the pool's prefix cache (``pool.cached_hashes(wire=True)``), so the router
        # asks the pools (``pool.lookup``: same overlaps, same choices) and no event is built.
        self.direct = (
            direct_lookup and events and cfg.kv_groups is None and not cfg.host_cache_blocks
        )
        self.engines = [
            PagedEngine(workload, cfg, tm, enable_kv_events=events and not self.direct,
                        hash_key=CLUSTER_HASH_KEY)
            for _ in range(n)
        ]  # fmt: skip
        if self.direct:
            self.router.lookup = self._overlap  # type: ignore[attr-defined]
            events = False
        self.owner = np.full(len(workload), -1, dtype=np.int64)  # replica of each request
        # the host pools whose events the router reads (a host tier's, when indexed)
        self.host_pools = [
            e.mgr.host_pool if events and index_host_events and e.host_tier else None
            for e in self.engines
        ]
        self.events = events  # whether run() drains the replicas' KV events into the router

    def _route(self, req: Any) -> int:
        router = self.router
        hashes: Any = []
        if router.needs_hashes:  # a pure function of the prompt: computed once per workload
            w = self.workload
            memo = w.memo(("route_hashes", self.cfg.block_size, self.direct))
            ck = w.content_key(req)
            got = memo.get(ck)
            if got is None:
                tokens = w.prompt_tokens(req)
                if self.direct:  # the 128-bit hashes pool.lookup takes
                    got = hash_blocks(tokens, self.cfg.block_size, key=CLUSTER_HASH_KEY)
                else:
                    got = prompt_hash_array(tokens, self.cfg.block_size, CLUSTER_HASH_KEY)
                memo[ck] = got
            hashes = got if self.direct else got.tolist()  # type: ignore[attr-defined]
        loads = [Load(e.queued_tokens, e.blocks_in_use) for e in self.engines]
        return router.choose(hashes, req.prompt_len, loads)

    def _overlap(self, hashes: np.ndarray) -> List[float]:
        """Per replica, its cached prefix of ``hashes`` in blocks (the direct path)."""
        n = len(hashes)
        out: List[float] = []
        for e in self.engines:
            k = len(e.pool.lookup(hashes))
            c = e.router_lookups  # not the engine's own lookups: taken out of its counters
            c[0] += 1
            c[1] += n
            c[2] += k
            out.append(float(k))
        return out

    def run(
        self,
        progress: Optional[Progress] = None,
        stop: Optional[Callable[["Cluster"], bool]] = None,
        stop_every: int = 512,
    ) -> ClusterResult:
        """Replay the whole workload; every engine's pool is checked at the end.

        ``stop(cluster)``, asked every ``stop_every`` steps, may end the replay early: it then
        raises :class:`ReplayStopped` (a planner's verdict is already known)."""
        reqs = self.workload.requests
        engines = self.engines
        router = self.router
        events = self.events
        tick = ProgressThrottle(progress) if progress is not None else None
        busy: List[Any] = []  # heap of (engine clock, index) of the engines with work
        nxt = 0
        done_steps = 0
        while True:
            t_arr = reqs[nxt].arrival if nxt < len(reqs) else None
            if busy and (t_arr is None or busy[0][0] < t_arr):
                _, i = heapq.heappop(busy)
                e = engines[i]
                # its steps that start before the next arrival run before it in any order
                # (engines meet only at arrivals), so it may take several in one call
                e.horizon = math.inf if t_arr is None else t_arr
                before = e.steps
                e.step()
                if events:
                    router.observe(i, e.pool.take_events())
                    hp = self.host_pools[i]
                    if hp is not None:
                        router.observe(i, hp.take_events())
                if not e.idle:
                    heapq.heappush(busy, (e.now, i))
                k = e.steps - before
                done_steps += k
                if stop is not None and done_steps % stop_every < k and stop(self):
                    raise ReplayStopped(done_steps, nxt)
                if tick is not None:
                    tick.step(done_steps, sum(x.finished_reqs for x in engines), e.now)
                continue
            if t_arr is None:
                break
            req = reqs[nxt]
            nxt += 1
            i = self._route(req)
            self.owner[req.index] = i
            e = engines[i]
            was_idle = e.idle
            if was_idle and e.now < t_arr:
                e.now = t_arr
            e.submit(req)
            if was_idle:
                heapq.heappush(busy, (e.now, i))
        if tick is not None:
            tick.close(sum(x.finished_reqs for x in engines), max(e.now for e in engines))
        return self._result()

    def _result(self) -> ClusterResult:
        results = [e.result() for e in self.engines]
        per = [
            _replica_summary(e.rec, self.owner == i, res.summary)
            for i, (e, res) in enumerate(zip(self.engines, results))
        ]
        summary = _aggregate(self.engines, self.owner, per)
        summary["wall_s"] = time.perf_counter() - self.wall0
        summary["allocator_share"] = (
            summary["allocator_s"] / summary["wall_s"] if summary["wall_s"] > 0 else 0.0
        )
        summary["replicas"] = len(self.engines)
        router = self.router.describe()
        if self.router.needs_events and any(e.host_tier for e in self.engines):
            router["indexes_host_events"] = any(hp is not None for hp in self.host_pools)
        return ClusterResult(summary, per, router, results)


class ReplayStopped(Exception):
    """A replay ended early by its ``stop`` callback (after ``steps`` steps and ``arrived``
    arrivals)."""

    def __init__(self, steps: int, arrived: int) -> None:
        super().__init__(f"replay stopped after {steps} steps, {arrived} arrivals")
        self.steps = steps
        self.arrived = arrived


def _replica_summary(rec: Recorder, mine: np.ndarray, full: Dict[str, Any]) -> Dict[str, Any]:
    """One replica's summary over its own requests (the recorder has a slot for every one)."""
    own = rec.summary(mask=mine)  # the request figures of its own requests, its counters
    own["wall_s"] = full["wall_s"]
    return own


def _aggregate(
    engines: List[PagedEngine], owner: np.ndarray, per: List[Dict[str, Any]]
) -> Dict[str, Any]:
    """The cluster's summary: request figures over all requests, the rest per replica."""
    first = engines[0].rec
    merged = Recorder(first.arrival, first.capacity_slots * len(engines), first.output_tokens,
                      first.samples, first.slo)  # fmt: skip
    for i, e in enumerate(engines):
        m = owner == i
        for name in (
            "admit",
            "first_token",
            "finish",
            "prompt_tokens",
            "cached_tokens",
            "rejected",
        ):
            getattr(merged, name)[m] = getattr(e.rec, name)[m]
    out = merged.summary()
    for k in _MEAN_KEYS:
        out[k] = float(np.mean([p[k] for p in per]))
    for k in _MAX_KEYS:
        out[k] = max(p[k] for p in per)
    for k in _SUM_KEYS:
        if k in per[0]:
            out[k] = sum(p[k] for p in per)
    if "host_stats" in per[0]:
        out["host_stats"] = {k: sum(p["host_stats"][k] for p in per) for k in per[0]["host_stats"]}
    stats = [e.pool.stats for e in engines]
    q = sum(s.query_tokens for s in stats)
    hits = sum(e._hit_tokens(s.hit_tokens) for e, s in zip(engines, stats))
    out["token_hit_rate"] = hits / q if q else 0.0
    out["blocks_in_use_at_end"] = sum(int(p["blocks_in_use_at_end"]) for p in per)
    out["cached_blocks_at_end"] = sum(int(p["cached_blocks_at_end"]) for p in per)
    if "host_hit_tokens" in out:
        prompt = out["prompt_tokens"]
        host = out["host_hit_tokens"]
        out["prefix_hit_rate_host"] = host / prompt if prompt else 0.0
        out["prefix_hit_rate_device"] = out["prefix_hit_rate"] - out["prefix_hit_rate_host"]
    if "groups" in per[0]:  # hybrid models: per layer kind, the busiest replica's peak, the mean
        out["groups"] = [
            dict(g, peak_blocks=max(p["groups"][k]["peak_blocks"] for p in per),
                 peak_gib=max(p["groups"][k]["peak_gib"] for p in per),
                 mean_blocks=float(np.mean([p["groups"][k]["mean_blocks"] for p in per])),
                 mean_gib=float(np.mean([p["groups"][k]["mean_gib"] for p in per])))
            for k, g in enumerate(per[0]["groups"])
        ]  # fmt: skip
    counts = [p["requests"] for p in per]
    out["requests_per_replica_min"] = min(counts)
    out["requests_per_replica_max"] = max(counts)
    return out


def simulate_cluster(
    workload: Workload,
    cfg: SchedulerConfig,
    tm: TimeModel,
    replicas: int,
    router: str = "round_robin",
    overlap_weight: Optional[float] = None,
    progress: Optional[Progress] = None,
    index_host_events: bool = True,
) -> ClusterResult:
    """Replay ``workload`` on ``replicas`` engines behind ``router``; see :class:`Cluster`."""
    if len(workload) == 0:
        raise SimulationError("the workload has no requests")
    cl = Cluster(workload, cfg, tm, replicas, router, overlap_weight, index_host_events)
    return cl.run(progress)
