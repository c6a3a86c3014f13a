"""``kvblocks plan --gpu NAME[,NAME...] --trace FILE --ttft-p99 S [--tpot-p99 S] [--cost]``:
the cheapest cluster (GPU type x TP x PP x replicas x host cache x KV dtype) that meets the SLOs.

**Candidates.** Every GPU of ``--gpu``, every ``--tp`` (default 1, 2, 4, 8: those that divide
the model's heads) and ``--pp`` (default 1), every KV dtype of ``--kv-dtypes`` and host-cache
size of ``--host-cache``, and replica counts in ``--replicas``. A *family* is one of these
without the replica count; its memory bill either fits (weights and one KV block per GPU) or
the family is reported as "does not fit" without a replay.

**Disaggregation.** With ``disagg`` (``--disagg auto`` or a list of ``P:D``), a family without
a host cache also runs as ``P`` prefill + ``D`` decode replicas (:func:`disagg_splits`):
``auto`` tries, for each replica count ``n >= 2``, ``P`` = a quarter, half and three quarters
of ``n`` (rounded, within [1, n - 1]); a list tries exactly its splits. GPUs = (P + D) x TP x PP.

**Search** (exactly the answer of an exhaustive search, which replays every candidate to the
end and takes the cheapest that meets the SLOs). Every candidate, in order of cost
(:func:`cost_key`), is replayed until one meets the SLOs: that one is the answer, and every
cheaper candidate has been replayed and missed. No monotonicity is assumed (more replicas
usually help, but with a prefix-aware router they also split the cache). What makes it fast is
that a replay that misses stops as soon as its miss is certain
(:func:`~kvblocks.sim.plan.replays.slo_already_missed`: enough requests are already over a
target that the p99 is, whatever the rest do), and the cheapest candidates, the ones that miss,
are the overloaded ones, whose misses are certain early; only the answer is replayed to the
end. And a family whose TTFT floor (:class:`~kvblocks.sim.plan.replays.Floors`: requests
whose uncached prefill alone takes longer than the target) already puts its p99 over the target
is not replayed at all; with fewer such requests, each replay counts them late from its start.
The trace's parsing, its token ids and the router's prompt hashes are computed once and shared
by every replay; the idle and TTFT floors once per time model.

**Why not cheaper.** Every cheaper candidate is accounted for: it does not fit, its floor
misses, or it was replayed and missed an SLO (which, by how much, or where the replay stopped).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..errors import SimulationError
from ..report.fmt import json_safe
from ..report.simulation import _secs
from .replays import late_needed, slo_already_missed

__all__ = [
    "Candidate",
    "Family",
    "GpuPlan",
    "search",
    "candidates",
    "cost_key",
    "disagg_splits",
    "ttft_already_missed",
    "format_gpu_plan",
    "gpu_plan_json",
    "idle_prefill_s",
]


def idle_prefill_s(tm: Any, prompt_len: int, token_budget: int) -> float:
    """Seconds an idle replica takes to prefill one ``prompt_len``-token prompt (no prefix hit),
    chunk by chunk of ``token_budget``: a lower bound on that prompt's TTFT under any load."""
    total, pos = 0.0, 0
    while pos < prompt_len:
        c = min(token_budget, prompt_len - pos)
        pairs, reads = tm.prefill_attention([(pos, c)])
        total += tm.step(c, 0, 0, 0, pairs, reads)
        pos += c
    return total


MAX_REPLAYS = 256  # a search that needs more is too wide to answer in a minute


@dataclass
class Family:
    """One GPU type x TP x PP x KV dtype x host cache: a replica's shape."""

    gpu: str
    tp: int
    pp: int
    kv_dtype: str
    host_cache_gib: float
    usd_per_gpu_hour: float
    fits: bool = True
    why_not: str = ""  # when it does not fit
    idle_ttft_s: Optional[float] = None  # the p99 prompt's prefill alone on an idle replica
    engine: Any = None  # (bill, cfg, tm) when it fits

    @property
    def gpus_per_replica(self) -> int:
        return self.tp * self.pp

    def label(self, replicas: int, prefill: int = 0) -> str:
        host = f" +{self.host_cache_gib:g}G host" if self.host_cache_gib else ""
        shape = f"{prefill}P+{replicas - prefill}D" if prefill else f"{replicas}"
        return (f"{replicas * self.gpus_per_replica} x {self.gpu} ({shape} x TP{self.tp}"
                + (f" PP{self.pp}" if self.pp > 1 else "") + f", KV {self.kv_dtype}{host})")  # fmt: skip


@dataclass
class Candidate:
    """One configuration: a family at a replica count, and what its replay gave (if run)."""

    family: Family
    replicas: int  # in all (prefill + decode when disaggregated)
    prefill: int = 0  # > 0: disaggregated, this many prefill replicas, the rest decode
    ran: bool = False
    ttft_p99_s: Optional[float] = None
    tpot_p99_s: Optional[float] = None
    throughput_tok_s: float = 0.0
    goodput: float = 0.0
    rejected: int = 0
    meets: Optional[bool] = None  # None: not replayed (nor implied)
    reason: str = ""
    replay_s: float = 0.0  # wall seconds its replay took (to the end or to its stop)
    stopped: str = ""  # why its replay stopped early: "ttft", "tpot", "rejected" ("" : it did not)

    @property
    def gpus(self) -> int:
        return self.replicas * self.family.gpus_per_replica

    @property
    def usd_per_hour(self) -> float:
        return self.gpus * self.family.usd_per_gpu_hour

    @property
    def decode(self) -> int:
        return self.replicas - self.prefill if self.prefill else 0

    def label(self) -> str:
        return self.family.label(self.replicas, self.prefill)

    def as_dict(self) -> Dict[str, Any]:
        f = self.family
        return {
            "config": self.label(),
            "gpu": f.gpu,
            "tp": f.tp,
            "pp": f.pp,
            "replicas": self.replicas,
            "disagg": f"{self.prefill}:{self.decode}" if self.prefill else None,
            "gpus": self.gpus,
            "kv_dtype": f.kv_dtype,
            "host_cache_gib": f.host_cache_gib,
            "usd_per_hour": self.usd_per_hour,
            "simulated": self.ran,
            "idle_p99_prompt_ttft": f.idle_ttft_s,
            "ttft_p99": self.ttft_p99_s,
            "tpot_p99": self.tpot_p99_s,
            "throughput_tok_s": self.throughput_tok_s,
            "goodput": self.goodput,
            "rejected": self.rejected,
            "meets": self.meets,
            "reason": self.reason,
            "replay_s": self.replay_s,
        }


@dataclass
class GpuPlan:
    """The answer, the replays behind it and why each cheaper configuration fails."""

    ttft_p99_s: float
    tpot_p99_s: Optional[float]
    by_cost: bool
    best: Optional[Candidate]
    replayed: List[Candidate]
    cheaper: List[Candidate]  # cheaper than best, each with its reason
    unfit: List[Family] = field(default_factory=list)

    def as_dict(self) -> Dict[str, Any]:
        b = self.best
        head: Dict[str, Any] = {"answer": None}
        if b is not None:
            head = {
                "gpu": b.family.gpu,
                "gpus": b.gpus,
                "tp": b.family.tp,
                "pp": b.family.pp,
                "replicas": b.replicas,
                "disagg": b.as_dict()["disagg"],
                "kv_dtype": b.family.kv_dtype,
                "host_cache_gib": b.family.host_cache_gib,
                "usd_per_hour": b.usd_per_hour,
                "ttft_p99": b.ttft_p99_s,
                "tpot_p99": b.tpot_p99_s,
                "throughput_tok_s": b.throughput_tok_s,
                "goodput": b.goodput,
                "answer": b.as_dict(),
            }
        return {
            **head,
            "target": {"ttft_p99": self.ttft_p99_s, "tpot_p99": self.tpot_p99_s},
            "objective": "usd_per_hour" if self.by_cost else "gpus",
            "why_not_cheaper": [c.as_dict() for c in self.cheaper],
            "frontier": [c.as_dict() for c in self.replayed],
            "does_not_fit": [
                {"gpu": f.gpu, "tp": f.tp, "pp": f.pp, "kv_dtype": f.kv_dtype, "reason": f.why_not}
                for f in self.unfit
            ],
            "replays": sum(1 for c in self.replayed if c.ran),
        }


def ttft_already_missed(cluster: Any, target_s: float) -> bool:
    """Whether a replay in progress can no longer meet TTFT p99 <= ``target_s``
    (:func:`~kvblocks.sim.plan.replays.slo_already_missed`)."""
    return bool(slo_already_missed(cluster, target_s))


def disagg_splits(n: int, spec: Optional[List[Tuple[int, int]]]) -> List[int]:
    """Prefill replicas to try at ``n`` replicas in all: ``spec`` None (``--disagg auto``): a
    quarter, half and three quarters of ``n`` (rounded half up, within [1, n - 1]); a list of
    ``(P, D)``: the ``P`` of those with ``P + D == n``."""
    if spec is not None:
        return sorted({p for p, d in spec if p + d == n})
    if n < 2:
        return []
    return sorted({min(n - 1, max(1, math.floor(n * q + 0.5))) for q in (0.25, 0.5, 0.75)})


def cost_key(c: Candidate, by_cost: bool) -> Tuple[float, ...]:
    """The order of preference: $/hour (``by_cost``) or GPUs, then GPUs, host memory in all, the
    wider KV dtype, less TP, aggregated before disaggregated, fewer prefill replicas."""
    width = {"fp4": 0, "fp8": 1, "int8": 1}.get(c.family.kv_dtype, 2)
    first = c.usd_per_hour if by_cost else float(c.gpus)
    return (first, float(c.gpus), c.family.host_cache_gib * c.replicas, -width, c.family.tp,
            1 if c.prefill else 0, c.prefill)  # fmt: skip


_key = cost_key

_STOPPED = {
    "ttft": "TTFT p99 > {t}: {late} requests already past it (enough for the p99) after {share:.0f}% of the arrivals{pool}; replay stopped",
    "tpot": "TPOT p99 > {t}: {late} requests already over it (enough for the p99) after {share:.0f}% of the arrivals{pool}; replay stopped",
}


def _verdict(c: Candidate, s: Dict[str, Any], ttft: float, tpot: Optional[float], n: int) -> None:
    c.ran = True
    if s.get("stopped"):
        c.meets = False
        why = s.get("why") or "ttft"
        c.stopped = "rejected" if s.get("rejected") else why
        pool = f" to the {s['pool']} pool" if s.get("pool") else ""
        if why == "rejected" or s.get("rejected"):
            c.rejected = int(s.get("rejected") or 0)
            c.reason = (f"{c.rejected} request{'s' if c.rejected != 1 else ''} rejected (longer than the KV pool); "
                        "replay stopped")  # fmt: skip
            return
        t = _secs(ttft) if why == "ttft" else _secs(tpot)
        c.reason = _STOPPED[why].format(t=t, late=late_needed(n), share=100 * s["arrived_share"],
                                        pool=pool)  # fmt: skip
        return
    c.ttft_p99_s = s.get("ttft_p99_s")
    c.tpot_p99_s = s.get("tpot_p99_s")
    c.throughput_tok_s = float(s.get("throughput_tok_s") or 0.0)
    c.goodput = float(s.get("goodput") or 0.0)
    c.rejected = int(s.get("rejected") or 0)
    why = []
    if c.rejected:
        why.append(
            f"{c.rejected} request{'s' if c.rejected > 1 else ''} rejected (longer than the KV pool)"
        )
    if c.ttft_p99_s is None or c.ttft_p99_s > ttft:
        got = "-" if c.ttft_p99_s is None else _secs(c.ttft_p99_s)
        ratio = f" ({c.ttft_p99_s / ttft:.2f}x)" if c.ttft_p99_s else ""
        why.append(f"TTFT p99 {got} > {_secs(ttft)}{ratio}")
    if tpot is not None and (c.tpot_p99_s is None or c.tpot_p99_s > tpot):
        got = "-" if c.tpot_p99_s is None else _secs(c.tpot_p99_s)
        ratio = f" ({c.tpot_p99_s / tpot:.2f}x)" if c.tpot_p99_s else ""
        why.append(f"TPOT p99 {got} > {_secs(tpot)}{ratio}")
    c.meets = not why
    c.reason = "; ".join(why) if why else "meets the SLOs"


def candidates(
    fit: List[Family],
    counts: List[int],
    disagg: Optional[List[Tuple[int, int]]] = None,
    with_disagg: bool = False,
) -> List[Candidate]:
    """Every candidate of the fitting families: each replica count, and with ``with_disagg``
    each split of :func:`disagg_splits` (families without a host cache), in enumeration order."""
    out: List[Candidate] = []
    totals = sorted(set(counts) | ({p + d for p, d in disagg} if disagg else set()))
    for f in fit:
        for n in totals:
            if n in counts:
                out.append(Candidate(f, n))
            if with_disagg and not f.host_cache_gib:
                out.extend(Candidate(f, n, prefill=p) for p in disagg_splits(n, disagg))
    return out


def search(
    families: List[Family],
    replica_counts: List[int],
    replay: Callable[..., Dict[str, Any]],
    ttft_p99_s: float,
    tpot_p99_s: Optional[float] = None,
    by_cost: bool = False,
    done: Optional[Callable[[Candidate], None]] = None,
    requests: int = 0,
    disagg: Optional[List[Tuple[int, int]]] = None,
    with_disagg: bool = False,
    exhaustive: bool = False,
    floor: Optional[Callable[[Family], str]] = None,
) -> GpuPlan:
    """Replay the candidates cheapest first (``replay(family, replicas)``, or ``replay(family,
    replicas, prefill)`` for a disaggregated one, returns the summary) until one meets the SLOs;
    ``exhaustive``: replay every candidate and take the cheapest that meets them (the
    reference the fast search must equal). ``requests``: the workload's size (for the stop
    reasons). ``floor(family)``: a reason when the family misses at every replica count for
    certain (:func:`~kvblocks.sim.plan.replays.certainly_late`), else ""; its candidates are
    then not replayed."""
    counts = sorted(set(replica_counts))
    if not counts:
        raise SimulationError("the plan needs at least one replica count")
    fit = [f for f in families if f.fits]
    unfit = [f for f in families if not f.fits]
    if not fit:
        why = "; ".join(
            f"{f.gpu} TP{f.tp} PP{f.pp} KV {f.kv_dtype}: {f.why_not}" for f in unfit[:4]
        )
        raise SimulationError(f"no configuration fits in memory ({why}); widen --tp, --pp or --gpu")
    order = sorted(candidates(fit, counts, disagg, with_disagg), key=lambda c: cost_key(c, by_cost))
    replayed: List[Candidate] = []
    best: Optional[Candidate] = None
    floors: Dict[int, str] = {}
    for c in order:
        if floor is not None and not exhaustive:
            if id(c.family) not in floors:
                floors[id(c.family)] = floor(c.family)
            if floors[id(c.family)]:
                c.meets, c.reason = False, floors[id(c.family)]
                replayed.append(c)
                if done is not None:
                    done(c)
                continue
        if len(replayed) >= MAX_REPLAYS:
            raise SimulationError(
                f"more than {MAX_REPLAYS} replays; narrow --gpu, --tp, --replicas, --host-cache, "
                "--kv-dtypes or --disagg"
            )
        t0 = time.perf_counter()
        s = replay(c.family, c.replicas, c.prefill) if c.prefill else replay(c.family, c.replicas)
        c.replay_s = time.perf_counter() - t0
        _verdict(c, s, ttft_p99_s, tpot_p99_s, requests)
        replayed.append(c)
        if done is not None:
            done(c)
        if c.meets and best is None:
            best = c
            if not exhaustive:
                break
    cheaper: List[Candidate] = []
    if best is not None:
        bk = cost_key(best, by_cost)
        cheaper = [c for c in replayed if cost_key(c, by_cost) < bk]
        for f in unfit:
            for n in counts:
                c = Candidate(f, n, meets=False, reason=f"does not fit: {f.why_not}")
                if cost_key(c, by_cost) < bk:
                    cheaper.append(c)
        cheaper.sort(key=lambda c: cost_key(c, by_cost), reverse=True)
    return GpuPlan(ttft_p99_s, tpot_p99_s, by_cost, best, replayed, cheaper, unfit)


def _bound(v: Optional[float], over: bool, target: Optional[float]) -> str:
    """A p99 cell: the value, ``> target`` when it is certainly over, else ``-``."""
    if v is not None:
        return _secs(v)
    return "> " + _secs(target) if over and target is not None else "-"


def format_gpu_plan(plan: GpuPlan, header: List[str], show_cheaper: int = 8) -> str:
    """The frontier table (every replay), the answer and why the cheaper ones fail."""
    out = list(header)
    slo = f"TTFT p99 <= {_secs(plan.ttft_p99_s)}"
    if plan.tpot_p99_s is not None:
        slo += f", TPOT p99 <= {_secs(plan.tpot_p99_s)}"
    out.append(
        f"target    {slo}; cheapest by {'$/hour' if plan.by_cost else 'GPU count'}; "
        "'idle p99': the 99th-percentile prompt's prefill on an idle replica (no prefix hit: a floor under TTFT p99 when few prompts hit the cache); "
        "'fl': misses by the TTFT floor, not replayed"
    )
    out.append("")
    cols = [("configuration", 44), ("GPUs", 6), ("$/hour", 9), ("idle p99", 10), ("TTFT p99", 11),
            ("TPOT p99", 11), ("tok/s", 9), ("goodput", 9), ("", 4)]  # fmt: skip
    out.append("".join(f"{t:<{w}}" if i == 0 else f"{t:>{w}}" for i, (t, w) in enumerate(cols)))
    for c in sorted(plan.replayed, key=lambda c: _key(c, plan.by_cost)):
        out.append(
            f"{c.label():<44}{c.gpus:>6}{c.usd_per_hour:>9.2f}{_secs(c.family.idle_ttft_s):>10}"
            f"{_bound(c.ttft_p99_s, c.stopped == 'ttft' or not c.ran, plan.ttft_p99_s):>11}"
            f"{_bound(c.tpot_p99_s, c.stopped == 'tpot', plan.tpot_p99_s):>11}{c.throughput_tok_s:>9,.0f}{100 * c.goodput:>8.1f}%"
            f"{'  ok' if c.meets else '  --' if c.ran else '  fl'}"
        )
    for f in plan.unfit:
        out.append(f"{f.label(1):<44}  does not fit: {f.why_not}")
    out.append("")
    b = plan.best
    if b is None:
        close = min((c for c in plan.replayed if c.ttft_p99_s is not None),
                    key=lambda c: c.ttft_p99_s or 0.0, default=None)  # fmt: skip
        out.append("answer    no configuration in range meets the SLOs"
                   + (f"; closest: {close.label()} ({close.reason})" if close else ""))  # fmt: skip
        fast = [
            f
            for f in {id(c.family): c.family for c in plan.replayed}.values()
            if f.idle_ttft_s is not None
        ]
        if fast:
            f = min(fast, key=lambda f: f.idle_ttft_s or 0.0)
            if (f.idle_ttft_s or 0.0) > plan.ttft_p99_s:
                out.append(
                    f"why      the 99th-percentile prompt alone takes {_secs(f.idle_ttft_s)} to prefill on an idle "
                    f"{f.gpu} TP{f.tp} replica (the fastest here), more than the {_secs(plan.ttft_p99_s)} target "
                    "at any replica count: widen --tp, take a faster --gpu, or relax --ttft-p99"
                )
        return "\n".join(out)
    out.append(
        f"answer    {b.gpus} x {b.family.gpu}: "
        + (
            f"{b.prefill} prefill + {b.decode} decode replicas (disaggregated)"
            if b.prefill
            else f"{b.replicas} replica{'s' if b.replicas > 1 else ''}"
        )
        + f" x TP {b.family.tp}"
        f" x PP {b.family.pp}, KV {b.family.kv_dtype}"
        + (f", {b.family.host_cache_gib:g} GiB host cache each" if b.family.host_cache_gib else "")
        + f", ${b.usd_per_hour:,.2f}/hour: TTFT p99 {_secs(b.ttft_p99_s)}, TPOT p99 {_secs(b.tpot_p99_s)},"
        f" {b.throughput_tok_s:,.0f} tok/s, goodput {100 * b.goodput:.1f}%"
    )
    if plan.cheaper:
        out.append("why not cheaper:")
        for c in plan.cheaper[:show_cheaper]:
            out.append(f"  {c.label():<44} {c.reason}")
        if len(plan.cheaper) > show_cheaper:
            out.append(f"  ... and {len(plan.cheaper) - show_cheaper} more (--json lists them all)")
    return "\n".join(out)


def gpu_plan_json(plan: GpuPlan, extra: Dict[str, Any]) -> str:
    return json.dumps(json_safe({**plan.as_dict(), **extra}), indent=2)


def family_dict(f: Family) -> Dict[str, Any]:
    d = asdict(f)
    d.pop("engine", None)
    return d
