"""Text and JSON reports of a cluster simulation: the aggregate, then one row per replica."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

from ..models.spec import MemoryBill
from ..report.fmt import fmt_bytes, json_safe
from ..report.groups import bill_lines, usage_lines
from ..report.simulation import ROWS, _num, _pct, _secs
from .cluster import ClusterResult
from .prefixindex import HOST_CREDIT

__all__ = ["format_cluster", "cluster_json", "TIER_ROWS"]

# per-tier rows, shown when the replicas have a host tier
TIER_ROWS = [
    ("  from device memory", "prefix_hit_rate_device", _pct),
    ("  from the host tier", "prefix_hit_rate_host", _pct),
    ("demotions to the host", "host_demotions", _num),
    ("onloads (host -> device)", "onload_blocks", _num),
    ("offloads (device -> host)", "offload_blocks", _num),
    ("  of which write-through", "write_through_offload_blocks", _num),
    ("host evictions", "host_evictions", _num),
    ("demotions dropped", "host_dropped", _num),
    ("PCIe time in steps", "transfer_s", _secs),
]

_REPLICA_COLS = [
    ("replica", 8, lambda i, s: str(i)),
    ("requests", 10, lambda i, s: _num(s["requests"])),
    ("hit rate", 10, lambda i, s: _pct(s["prefix_hit_rate"])),
    ("TTFT p50", 11, lambda i, s: _secs(s["ttft_p50_s"])),
    ("TTFT p99", 11, lambda i, s: _secs(s["ttft_p99_s"])),
    ("mean KV", 9, lambda i, s: _pct(s["mean_kv_usage"])),
    ("evictions", 12, lambda i, s: _num(s["evictions"])),
    ("tok/s", 9, lambda i, s: _num(s["throughput_tok_s"], 0)),
]


def format_cluster(
    workload_name: str,
    wstats: Dict[str, float],
    bill: MemoryBill,
    cfg_desc: str,
    res: ClusterResult,
    host_desc: Optional[str] = None,
) -> str:
    """The human-readable cluster report."""
    s = res.summary
    n = len(res.replicas)
    m = bill.model
    out: List[str] = [
        f"workload  {workload_name}: {int(wstats['requests']):,} requests, "
        f"{int(wstats['prompt_tokens']):,} prompt + {int(wstats['output_tokens']):,} output tokens "
        f"over {wstats['span_s']:,.1f} s",
        f"model     {m.name}: KV {fmt_bytes(bill.kv_bytes_per_token)}/token = {m.kv_formula()}",
        f"replica   {fmt_bytes(bill.gpu_bytes)} GPU: {bill.num_blocks:,} blocks x {bill.block_size} "
        f"tokens ({bill.token_slots:,} token slots)" + (f"; {host_desc}" if host_desc else ""),
        *bill_lines(bill),
        f"cluster   {n} replica{_s(n)}, router {_router_desc(res.router)}",
        f"engine    {cfg_desc}",
        "",
        f"{'':<27}{f'cluster ({n} replica{_s(n)})':>24}",
    ]
    for label, key, fmt in ROWS:
        out.append(f"{label:<27}{fmt(s.get(key)):>24}")
        if key == "prefix_hit_rate" and "prefix_hit_rate_host" in s:
            for tl, tk, tf in TIER_ROWS:
                out.append(f"{tl:<27}{tf(s.get(tk)):>24}")
    out.append("")
    usage = usage_lines(s, ", busiest replica's peak, mean over replicas")
    if usage:
        out.extend(usage)
        out.append("")
    out.append("per replica (KV usage is time-weighted over its busy steps)")
    out.append(
        "".join(f"{t:<{w}}" if k == 0 else f"{t:>{w}}" for k, (t, w, _) in enumerate(_REPLICA_COLS))
    )
    for i, rs in enumerate(res.replicas):
        out.append(
            "".join(
                f"{f(i, rs):<{w}}" if k == 0 else f"{f(i, rs):>{w}}"
                for k, (_, w, f) in enumerate(_REPLICA_COLS)
            )  # fmt: skip
        )
    out.append("")
    out.append(
        f"allocator: {s['allocator_s']:.2f} s of {s['wall_s']:.2f} s replay wall time inside "
        f"BlockManager calls; {s['block_hits']:,} blocks served from the prefix caches; "
        f"pool.check() passed on every replica, every block free at the end."
    )
    return "\n".join(out)


def _s(n: int) -> str:
    return "" if n == 1 else "s"


def _router_desc(router: Dict[str, Any]) -> str:
    name = router["router"]
    if name == "prefix_aware":
        src = "KV events"
        if router.get("indexes_host_events"):
            src = f"device and host KV events, a host block counting {HOST_CREDIT:g}"
        return (
            f"prefix_aware (cost = {router['overlap_weight']:g} x prefill blocks + decode blocks, "
            f"prefixes from {src})"
        )
    return name


def cluster_json(
    workload_name: str,
    wstats: Dict[str, float],
    bill: MemoryBill,
    config: Dict[str, Any],
    time_model: Dict[str, float],
    res: ClusterResult,
    cluster: Dict[str, Any],
    extra: Optional[Dict[str, Any]] = None,
) -> str:
    """The machine-readable cluster report: ``paged`` is the aggregate, ``replicas`` the rest;
    ``extra`` keys first."""
    doc = {
        **(extra or {}),
        "workload": dict(wstats, name=workload_name),
        "memory": bill.as_dict(),
        "config": config,
        "time_model": time_model,
        "cluster": dict(cluster, replicas=len(res.replicas), **res.router),
        "paged": res.summary,
        "replicas": res.replicas,
        "contiguous": None,
    }
    return json.dumps(json_safe(doc), indent=2)
