"""Prefill/decode disaggregation (``simulate --disagg P:D``): P prefill replicas, D decode
replicas, the KV of each prompt moved between them over the GPU interconnect.

The replay runs in three stages, each on the existing machinery:

1. **Prefill pool**: a :class:`~kvblocks.sim.cluster.cluster.Cluster` of ``P`` paged engines
   (behind the router) replays every request with one output token: its prefill and its
   first token, which is when its KV is complete.
2. **Transfer**: the prompt's KV moves to a decode replica over the link. Its bytes are the
   memory bill's, ``prompt_len x kv_bytes_per_token`` (the whole model's, every layer; a
   request's parallel samples share it), split over the ``TP x PP`` GPUs of the replica as the
   KV is (times ``kv_copies`` where TP replicates KV heads), each GPU sending its share over
   its own link at the GPU catalog's ``link_gb_s`` (:mod:`kvblocks.sim.models.gpus`):
   ``seconds = prompt_len x kv_bytes_per_token x kv_copies / (TP x PP) / (link_gb_s x 1e9)``
   (:func:`transfer_seconds`). Transfers do not contend with each other or with the steps.
3. **Decode pool**: a cluster of ``D`` paged engines replays every request arriving when its
   KV has landed, with its whole prompt to place in blocks and its output to generate. The
   prompt's arrival costs no compute (:class:`KVArrivalTime`: a step's prefill tokens are
   free, its decodes and KV reads are not) and the decode pool's token budget admits a whole
   prompt in one step. Its first token is the one the prefill pool made, delivered then.

A request's TTFT runs from its arrival to that first token on the decode side, so it includes
the prefill pool's queue and prefill, the transfer and the decode pool's admission; its TPOT
and end-to-end latency are the decode pool's. The prefill pool does not wait for the decode
pool (no back-pressure: its finished KV is assumed to leave at once), and a recompute
preemption on the decode side re-places the prompt at no compute cost.

>>> from kvblocks.sim import SchedulerConfig, TimeModel, builtin_workload, get_model
>>> w = builtin_workload().head(30)
>>> tm = TimeModel.for_model(get_model("llama-3.1-8b"))
>>> res = simulate_disagg(w, SchedulerConfig(num_blocks=3000), tm, 1, 2, 131072, 450.0)
>>> res.summary["completed"], len(res.prefill.replicas), len(res.decode.replicas)
(30, 1, 2)
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..engine.batching import SchedulerConfig
from ..engine.metrics import Recorder
from ..engine.progress import Progress
from ..engine.timing import TimeModel
from ..errors import SimulationError
from ..workload.traces import Request, Workload
from .cluster import Cluster, ClusterResult, ReplayStopped, simulate_cluster

__all__ = [
    "DisaggResult",
    "DisaggStopped",
    "KVArrivalTime",
    "parse_disagg",
    "simulate_disagg",
    "transfer_seconds",
]

MAX_POOL = 1024  # replicas per pool (as --replicas)


def parse_disagg(text: str) -> Tuple[int, int]:
    """``"P:D"`` -> ``(P, D)``, both integers in [1, 1024]; anything else a one-line error."""
    parts = str(text).split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise SimulationError(
            f"--disagg takes P:D, prefill and decode replicas (e.g. 1:3), got {text!r}"
        )
    p, d = int(parts[0]), int(parts[1])
    for name, v in (("prefill", p), ("decode", d)):
        if not 1 <= v <= MAX_POOL:
            raise SimulationError(
                f"--disagg {text}: {name} replicas must be in [1, {MAX_POOL}], got {v}"
            )
    return p, d


def transfer_seconds(
    prompt_tokens: Any, kv_bytes_per_token: float, link_gb_s: float, gpus: int = 1,
    kv_copies: int = 1,
) -> Any:  # fmt: skip
    """Seconds to move the KV of ``prompt_tokens`` from a prefill to a decode replica: each of
    its ``gpus`` GPUs sends its share (``kv_copies``: KV heads replicated by TP) over its own
    link of ``link_gb_s`` GB/s."""
    if not link_gb_s > 0:
        raise SimulationError(f"the interconnect bandwidth must be > 0 GB/s, got {link_gb_s}")
    per_gpu = np.asarray(prompt_tokens, dtype=np.float64) * kv_bytes_per_token * kv_copies / gpus
    return per_gpu / (link_gb_s * 1e9)


@dataclass(frozen=True)
class KVArrivalTime(TimeModel):
    """The decode pool's step time: a step's prefill tokens are prompts whose KV arrived over
    the link, placed in blocks at no compute cost; decodes and KV reads cost as ever."""

    def step(
        self,
        prefill_tokens: int,
        decode_tokens: int,
        kv_tokens_read: float,
        swap_bytes: int = 0,
        prefill_pairs: float = 0.0,
        prefill_reads: float = 0.0,
    ) -> float:
        return TimeModel.step(self, 0, decode_tokens, kv_tokens_read, swap_bytes)

    @classmethod
    def of(cls, tm: TimeModel) -> "KVArrivalTime":
        return cls(**{f.name: getattr(tm, f.name) for f in fields(tm) if f.init})


@dataclass
class DisaggResult:
    """The end-to-end summary, the two pools' cluster results and the transfers."""

    summary: Dict[str, Any]
    prefill: ClusterResult
    decode: ClusterResult
    transfer_s: np.ndarray  # per request


class DisaggStopped(Exception):
    """A planner's replay ended early: its SLO is certainly missed (``why``: ``"ttft"``,
    ``"tpot"`` or ``"rejected"``), found in ``pool`` ("prefill" or "decode")."""

    def __init__(self, pool: str, why: str, arrived_share: float, rejected: int) -> None:
        super().__init__(f"disaggregated replay stopped in the {pool} pool ({why})")
        self.pool, self.why = pool, why
        self.arrived_share, self.rejected = arrived_share, rejected


def _stoppable(w: Workload, cfg: SchedulerConfig, tm: TimeModel, n: int, router: str,
               overlap_weight: Optional[float], progress: Optional[Progress], rule: Any,
               pool: str) -> ClusterResult:  # fmt: skip
    """A pool's cluster replay, which ``rule`` (a planner's stop rule, or None) may end."""
    if rule is None:
        return simulate_cluster(w, cfg, tm, n, router, overlap_weight, progress)
    cl = Cluster(w, cfg, tm, n, router, overlap_weight)
    try:
        return cl.run(progress, rule)
    except ReplayStopped as e:
        rej = sum(int(x.rec.rejected.sum()) for x in cl.engines)
        raise DisaggStopped(pool, rule.why, e.arrived / max(1, len(w)), rej) from None


def _derived(w: Workload, reqs: List[Request]) -> Workload:
    out = Workload(w.name, reqs, w.kind)
    out._book, out._segments, out._memo = w._book, w._segments, w._memo
    return out


def simulate_disagg(
    workload: Workload,
    cfg: SchedulerConfig,
    tm: TimeModel,
    prefill: int,
    decode: int,
    kv_bytes_per_token: float,
    link_gb_s: float,
    router: str = "round_robin",
    overlap_weight: Optional[float] = None,
    progress: Optional[Progress] = None,
    slo: Optional[Tuple[float, Optional[float]]] = None,
    known: Optional[np.ndarray] = None,
) -> DisaggResult:
    """Replay ``workload`` on ``prefill`` prefill and ``decode`` decode replicas (see the
    module docstring); ``kv_bytes_per_token`` from the memory bill, ``link_gb_s`` from the
    GPU catalog. ``slo`` (TTFT p99, TPOT p99 or None; the planner's) stops the replay with
    :class:`DisaggStopped` as soon as it certainly misses them: in the prefill pool when the
    prefill alone makes too many requests late (their TTFT can only grow), in the decode pool
    by the end-to-end TTFT and the TPOT (:mod:`kvblocks.sim.cluster.stoprule`); ``known`` marks
    the requests certainly over the TTFT target from the start."""
    rules: List[Any] = [None, None]
    if slo is not None:
        from .stoprule import StopRule

        rules = [StopRule(slo[0], known=known), StopRule(slo[0], slo[1])]
    if len(workload) == 0:
        raise SimulationError("the workload has no requests")
    reqs = workload.requests
    # 1. prefill: every request with one output token
    pre_w = _derived(workload, [Request(r.index, r.arrival, r.prompt_len, 1, r.n, r.hash_ids,
                                        r.segments, r.output_id) for r in reqs])  # fmt: skip
    pre = _stoppable(pre_w, cfg, tm, prefill, router, overlap_weight, progress, rules[0],
                     "prefill")  # fmt: skip
    pre_rec = _merged(pre, len(reqs))
    # 2. transfer
    par = tm.parallel
    prompt = np.array([r.prompt_len for r in reqs], dtype=np.float64)
    xfer = transfer_seconds(prompt, kv_bytes_per_token, link_gb_s, par.gpus, par.kv_copies)
    ready = pre_rec.first_token + xfer
    # 3. decode: arrivals when the KV lands, re-indexed in that order
    ok = np.flatnonzero(np.isfinite(ready))
    order = ok[np.argsort(ready[ok], kind="stable")]
    dec_reqs = [Request(k, float(ready[i]), reqs[i].prompt_len, reqs[i].output_len, reqs[i].n,
                        reqs[i].hash_ids, reqs[i].segments, reqs[i].output_id)
                for k, i in enumerate(order)]  # fmt: skip
    longest = max((r.prompt_len for r in reqs), default=1)
    dcfg = replace(
        cfg, token_budget=max(cfg.token_budget, min(longest + cfg.max_num_seqs, 1 << 30))
    )
    if rules[1] is not None:  # the decode pool's TTFT counts from the original arrivals
        rules[1].arrival = pre_rec.arrival[order]
        rules[1].known = known[order] if known is not None else None
    if dec_reqs:
        dec = _stoppable(_derived(workload, dec_reqs), dcfg, KVArrivalTime.of(tm), decode,
                         router, overlap_weight, None, rules[1], "decode")  # fmt: skip
    else:
        raise SimulationError("no request finished its prefill: nothing to decode")
    dec_rec = _merged(dec, len(dec_reqs))
    # end to end, in the workload's order
    first = pre_rec.arrival
    rec = Recorder(first, (prefill + decode) * cfg.num_blocks * cfg.block_size,
                   np.array([r.output_len * r.n for r in reqs], dtype=np.int64),
                   np.array([r.n for r in reqs], dtype=np.int64),
                   (cfg.slo_ttft_s, cfg.slo_tpot_s))  # fmt: skip
    rec.admit[:] = pre_rec.admit
    rec.prompt_tokens[:] = pre_rec.prompt_tokens
    rec.cached_tokens[:] = pre_rec.cached_tokens
    rec.rejected[:] = pre_rec.rejected
    rec.first_token[order] = dec_rec.first_token
    rec.finish[order] = dec_rec.finish
    rec.rejected[order] |= dec_rec.rejected
    summary = rec.summary()
    ps, ds = pre.summary, dec.summary
    summary.update(
        disagg={"prefill_replicas": prefill, "decode_replicas": decode,
                "link_gb_s": link_gb_s, "kv_bytes_per_token": kv_bytes_per_token},
        transfer_p50_s=float(np.percentile(xfer, 50)),
        transfer_p99_s=float(np.percentile(xfer, 99)),
        transfer_bytes=float((prompt * kv_bytes_per_token).sum()),
        prefill_makespan_s=ps["makespan_s"],
        steps=ps["steps"] + ds["steps"],
        evictions=ps["evictions"] + ds["evictions"],
        preemptions=ps["preemptions"] + ds["preemptions"],
        peak_kv_usage=max(ps["peak_kv_usage"], ds["peak_kv_usage"]),
        mean_kv_usage=(prefill * ps["mean_kv_usage"] + decode * ds["mean_kv_usage"])
        / (prefill + decode),
        peak_concurrency=ds["peak_concurrency"],
        mean_concurrency=ds["mean_concurrency"],
        internal_fragmentation=ds["internal_fragmentation"],
        allocator_s=ps["allocator_s"] + ds["allocator_s"],
        wall_s=ps["wall_s"] + ds["wall_s"],
    )  # fmt: skip
    return DisaggResult(summary, pre, dec, xfer)


def _merged(res: ClusterResult, n: int) -> Recorder:
    """The per-request timings of a cluster replay, over all its replicas."""
    first = res.results[0].recorder
    out = Recorder(first.arrival, first.capacity_slots, first.output_tokens, first.samples,
                   first.slo)  # fmt: skip
    for r in res.results:
        rec = r.recorder
        for name in ("admit", "first_token", "finish", "prompt_tokens", "cached_tokens"):
            src, dst = getattr(rec, name), getattr(out, name)
            m = ~np.isnan(src) if src.dtype.kind == "f" else src != 0
            dst[m] = src[m]
        out.rejected |= rec.rejected
    assert out.arrival.shape[0] == n
    return out


def format_disagg(workload_name: str, wstats: Dict[str, float], bill: Any, cfg_desc: str,
                  res: DisaggResult) -> str:  # fmt: skip
    """The human-readable report: end to end, then each pool."""
    from ..report.fmt import fmt_bytes
    from ..report.simulation import ROWS

    s, d = res.summary, res.summary["disagg"]
    p, n = d["prefill_replicas"], d["decode_replicas"]
    m = bill.model
    out: List[str] = [
        f"workload  {workload_name}: {int(wstats['requests']):,} requests, "
        f"{int(wstats['prompt_tokens']):,} prompt + {int(wstats['output_tokens']):,} output tokens "
        f"over {wstats['span_s']:,.1f} s",
        f"model     {m.name}: KV {fmt_bytes(bill.kv_bytes_per_token)}/token = {m.kv_formula()}",
        f"replica   {fmt_bytes(bill.gpu_bytes)} GPU: {bill.num_blocks:,} blocks x {bill.block_size} "
        f"tokens ({bill.token_slots:,} token slots)",
        f"disagg    {p} prefill + {n} decode replicas; KV moved over the link at "
        f"{d['link_gb_s']:g} GB/s per GPU",
        f"engine    {cfg_desc}",
        "",
        f"{'':<27}{'end to end':>14}{'prefill pool':>16}{'decode pool':>16}",
    ]
    for label, key, fmt in ROWS:
        out.append(f"{label:<27}{fmt(s.get(key)):>14}{fmt(res.prefill.summary.get(key)):>16}"
                   f"{fmt(res.decode.summary.get(key)):>16}")  # fmt: skip
    out.append("")
    out.append(
        f"KV transfer: {fmt_bytes(s['transfer_bytes'])} in all; per request p50 "
        f"{1e3 * s['transfer_p50_s']:.2f} ms, p99 {1e3 * s['transfer_p99_s']:.2f} ms (in TTFT). "
        "Prefill pool columns: prefill and first token only; decode pool: from the KV's arrival."
    )
    return "\n".join(out)


def disagg_json(workload_name: str, wstats: Dict[str, float], bill: Any, config: Dict[str, Any],
                time_model: Dict[str, Any], res: DisaggResult, head: Dict[str, Any]) -> str:  # fmt: skip
    """The machine-readable report: the end-to-end summary as ``paged``, each pool's aggregate
    and replicas."""
    import json

    from ..report.fmt import json_safe

    doc: Dict[str, Any] = {
        **head,
        "workload": dict(wstats, name=workload_name),
        "memory": bill.as_dict(),
        "config": config,
        "time_model": time_model,
        "disagg": res.summary["disagg"],
        "paged": res.summary,
        "contiguous": None,
        "prefill_pool": dict(res.prefill.summary, replicas=res.prefill.replicas),
        "decode_pool": dict(res.decode.summary, replicas=res.decode.replicas),
    }
    return json.dumps(json_safe(doc), indent=2)
