"""``kvblocks plan --trace FILE --ttft-p99 SECONDS``: the cheapest cluster that meets a target.

The planner simulates the trace on every configuration of its range: each replica count
(``--replicas``, default ``1-8``) times each host-cache size per replica (``--host-cache``, a
list of GiB, default ``0,256``: none, and the 256 GiB of host memory per GPU of an 8-GPU server
with 2 TiB), all behind one router (``--router``, default ``prefix_aware``), with the write
policy of ``--host-write-through``. Each run is a full
:class:`~kvblocks.sim.cluster.cluster.Cluster` replay, so the curve it prints (GPUs, host memory, hit
rate and its host share, TTFT p50/p99, throughput) is the simulator's, not a formula.

**Cheapest.** Fewest GPUs first; among equal GPU counts, the least host memory in all. A
configuration meets the target when its TTFT p99 is at most ``--ttft-p99`` seconds and it
rejected no request. When none does, :func:`cheapest` raises
:class:`~kvblocks.sim.errors.SimulationError` naming the closest one (lowest TTFT p99).

>>> parse_counts("1-3,6", "--replicas")
[1, 2, 3, 6]
>>> parse_sizes("0,64", "--host-cache")
[0.0, 64.0]
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Dict, List, Optional

from .. import limits
from ..cluster.cluster import Cluster
from ..engine.batching import SchedulerConfig
from ..engine.progress import Progress
from ..engine.timing import TimeModel
from ..errors import SimulationError
from ..report.fmt import json_safe
from ..report.simulation import _pct, _secs
from ..tier.host import host_cache_blocks
from ..workload.traces import Workload

__all__ = [
    "PlanPoint",
    "CapacityPlan",
    "parse_counts",
    "parse_sizes",
    "sweep",
    "cheapest",
    "format_capacity",
    "capacity_json",
]

MAX_CONFIGS = 256  # configurations one plan may simulate


@dataclass(frozen=True)
class PlanPoint:
    """One simulated configuration and what it achieved."""

    replicas: int
    host_cache_gib: float  # per replica
    gpus: int
    host_mem_gib: float  # in all
    hit_rate: float
    hit_rate_host: Optional[float]  # None without a host tier
    ttft_p50_s: Optional[float]
    ttft_p99_s: Optional[float]
    throughput_tok_s: float
    rejected: int
    meets: bool
    groups: Optional[List[Dict[str, Any]]] = (
        None  # hybrid models: blocks per layer kind, per replica
    )


@dataclass
class CapacityPlan:
    """The curve, the target and the cheapest point meeting it."""

    target_ttft_p99_s: float
    router: str
    points: List[PlanPoint]
    best: PlanPoint
    host_write_through: bool = False

    def as_dict(self) -> Dict[str, Any]:
        return {
            "target_ttft_p99_s": self.target_ttft_p99_s,
            "router": self.router,
            "host_write_through": self.host_write_through,
            "best": asdict(self.best),
            "curve": [asdict(p) for p in self.points],
        }


def parse_counts(text: str, flag: str) -> List[int]:
    """``"1-4,8"`` -> ``[1, 2, 3, 4, 8]`` (sorted, unique; each within ``limits.REPLICAS``)."""
    out: set = set()
    for part in str(text).split(","):
        part = part.strip()
        lo_s, sep, hi_s = part.partition("-")
        try:
            lo = int(lo_s)
            hi = int(hi_s) if sep else lo
        except ValueError:
            raise SimulationError(f"{flag}: {part!r} is not N or LO-HI (e.g. 1-8,12)") from None
        for v in (lo, hi):
            if not limits.REPLICAS.lo <= v <= limits.REPLICAS.hi:
                raise SimulationError(f"{flag}: {v} is not in [1, {limits.REPLICAS.hi}]")
        if lo > hi:
            raise SimulationError(f"{flag}: {part!r} has LO > HI")
        out.update(range(lo, hi + 1))
    return sorted(out)


def parse_sizes(text: str, flag: str) -> List[float]:
    """``"0,64,256"`` -> ``[0.0, 64.0, 256.0]`` GiB (each within ``limits.HOST_CACHE``)."""
    out: set = set()
    for part in str(text).split(","):
        try:
            out.add(float(limits.HOST_CACHE.parse(part.strip())))
        except Exception:
            raise SimulationError(
                f"{flag}: {part.strip()!r} must be {limits.HOST_CACHE.describe()}"
            ) from None
    return sorted(out)


def sweep(
    workload: Workload,
    cfg: SchedulerConfig,
    tm: TimeModel,
    target_ttft_p99_s: float,
    replica_counts: List[int],
    host_sizes_gib: List[float],
    router: str = "prefix_aware",
    progress: Optional[Callable[[int, int], None]] = None,
    replay_progress: Optional[Callable[[int], Progress]] = None,
    host_write_through: bool = False,
) -> List[PlanPoint]:
    """Simulate every (replica count, host-cache size) and return the curve.

    ``progress(done, total)`` is called after each configuration; ``replay_progress(k)`` may
    return a per-replay progress callback for configuration ``k``; ``host_write_through``
    sets the host tiers' write policy."""
    target = limits.TTFT_P99.check_float(target_ttft_p99_s)
    if not replica_counts or not host_sizes_gib:
        raise SimulationError("the plan needs at least one replica count and one host size")
    if len(workload) == 0:
        raise SimulationError("the workload has no requests")
    total = len(replica_counts) * len(host_sizes_gib)
    if total > MAX_CONFIGS:
        raise SimulationError(
            f"{total} configurations to simulate, more than {MAX_CONFIGS}; narrow --replicas "
            f"or --host-cache"
        )
    # validate every configuration before the first long replay
    if host_write_through and not any(g > 0 for g in host_sizes_gib):
        raise SimulationError("--host-write-through needs a host tier (--host-cache GiB > 0)")
    cfgs = [
        replace(
            cfg,
            host_cache_blocks=host_cache_blocks(g, cfg.block_bytes),
            host_write_through=host_write_through,
        )
        if g > 0
        else replace(cfg, host_cache_blocks=0, host_write_through=False)
        for g in host_sizes_gib
    ]
    clusters_args = [(n, g, c) for n in replica_counts for g, c in zip(host_sizes_gib, cfgs)]
    for n, _, c in clusters_args:
        limits.REPLICAS.check(n)
        c.validate()
    if any(g > 0 for g in host_sizes_gib):
        from ..tier.host import HOST_TIER_MISSING, host_tier_available

        if not host_tier_available():
            raise SimulationError(HOST_TIER_MISSING)
    points: List[PlanPoint] = []
    for k, (n, g, c) in enumerate(clusters_args):
        prog = replay_progress(k) if replay_progress is not None else None
        res = Cluster(workload, c, tm, n, router).run(prog)
        s = res.summary
        p99 = s["ttft_p99_s"]
        rejected = int(s["rejected"])
        points.append(
            PlanPoint(
                replicas=n,
                host_cache_gib=g,
                gpus=n,
                host_mem_gib=g * n,
                hit_rate=float(s["prefix_hit_rate"]),
                hit_rate_host=s.get("prefix_hit_rate_host"),
                ttft_p50_s=s["ttft_p50_s"],
                ttft_p99_s=p99,
                throughput_tok_s=float(s["throughput_tok_s"]),
                rejected=rejected,
                meets=p99 is not None and p99 <= target and rejected == 0,
                groups=s.get("groups"),
            )
        )
        if progress is not None:
            progress(k + 1, total)
    return points


def cheapest(points: List[PlanPoint], target_ttft_p99_s: float) -> PlanPoint:
    """Fewest GPUs, then least host memory, among the points meeting the target (TTFT p99
    at most ``target_ttft_p99_s``, nothing rejected); SimulationError naming the closest
    point when none does."""
    target = limits.TTFT_P99.check_float(target_ttft_p99_s)
    ok = [
        p for p in points if p.ttft_p99_s is not None and p.ttft_p99_s <= target and not p.rejected
    ]
    if ok:
        return min(ok, key=lambda p: (p.gpus, p.host_mem_gib))
    timed = [p for p in points if p.ttft_p99_s is not None]
    if not timed:
        raise SimulationError("no configuration served any request")
    c = min(timed, key=lambda p: (p.ttft_p99_s, p.gpus, p.host_mem_gib))
    assert c.ttft_p99_s is not None
    raise SimulationError(
        f"no configuration in range meets TTFT p99 <= {target:g} s; closest: "
        f"{_name(c)} with TTFT p99 {c.ttft_p99_s:.3f} s"
        + (f" ({c.rejected} rejected)" if c.rejected else "")
        + "; widen --replicas or --host-cache"
    )


def _name(p: PlanPoint) -> str:
    host = f" + {p.host_cache_gib:g} GiB host cache each" if p.host_cache_gib else ""
    return f"{p.replicas} replica{'s' if p.replicas > 1 else ''}{host}"


def format_capacity(plan: CapacityPlan, header: List[str]) -> str:
    """The human-readable plan: the curve, then the answer."""
    cols = [("GPUs", 6), ("host GiB", 10), ("hit rate", 10), ("host hits", 11),
            ("TTFT p50", 11), ("TTFT p99", 11), ("tok/s", 9), ("meets", 7)]  # fmt: skip
    out = list(header)
    out.append(f"target    TTFT p99 <= {plan.target_ttft_p99_s:g} s, router {plan.router}")
    if any(p.host_cache_gib > 0 for p in plan.points):
        policy = "write-through" if plan.host_write_through else "write-back"
        out.append(f"host      one host tier per replica ({policy}); 'host GiB' is the total")
    out.append("")
    out.append("".join(f"{t:>{w}}" for t, w in cols))
    for p in plan.points:
        cells = [
            str(p.gpus),
            f"{p.host_mem_gib:g}",
            _pct(p.hit_rate),
            _pct(p.hit_rate_host),
            _secs(p.ttft_p50_s),
            _secs(p.ttft_p99_s),
            f"{p.throughput_tok_s:,.0f}",
            "yes" if p.meets else "no",
        ]
        mark = "  <- cheapest" if p is plan.best else ""
        out.append("".join(f"{c:>{w}}" for c, (_, w) in zip(cells, cols)) + mark)
    out.append("")
    b = plan.best
    out.append(
        f"cheapest: {_name(b)} ({b.gpus} GPU{'s' if b.gpus > 1 else ''}, {b.host_mem_gib:g} GiB "
        f"host memory): TTFT p99 {_secs(b.ttft_p99_s)}, hit rate {_pct(b.hit_rate)}, "
        f"{b.throughput_tok_s:,.0f} output tok/s"
    )
    return "\n".join(out)


def capacity_json(plan: CapacityPlan, extra: Dict[str, Any]) -> str:
    """The machine-readable plan."""
    return json.dumps(json_safe(dict(extra, **plan.as_dict())), indent=2)
