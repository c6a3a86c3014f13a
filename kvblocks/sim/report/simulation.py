"""Text and JSON reports of a simulation: the memory bill and the summary table."""

from __future__ import annotations

import json
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from ..engine.metrics import SimResult
from ..models.spec import MemoryBill
from .fmt import fmt_bytes, json_safe
from .groups import bill_lines, gain_line, hybrid_gain, usage_lines

__all__ = ["format_simulation", "simulation_json"]


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{100.0 * v:.1f}%"


def _secs(v: Optional[float]) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v * 1e3:.0f} ms" if v < 1.0 else f"{v:,.2f} s"


def _num(v: Any, digits: int = 0) -> str:
    if v is None:
        return "-"
    return f"{v:,.{digits}f}" if isinstance(v, float) else f"{v:,}"


ROWS: List[Tuple[str, str, Any]] = [
    ("peak KV usage", "peak_kv_usage", _pct),
    ("mean KV usage", "mean_kv_usage", _pct),
    ("peak concurrency (seqs)", "peak_concurrency", _num),
    ("mean concurrency (seqs)", "mean_concurrency", lambda v: _num(v, 1)),
    ("internal fragmentation", "internal_fragmentation", _pct),
    ("prefix hit rate (tokens)", "prefix_hit_rate", _pct),
    ("evictions (blocks)", "evictions", _num),
    ("preemptions", "preemptions", _num),
    ("rejected requests", "rejected", _num),
    ("throughput (output tok/s)", "throughput_tok_s", lambda v: _num(v, 0)),
    ("throughput (requests/s)", "throughput_req_s", lambda v: _num(v, 2)),
    ("queueing delay p50", "queue_p50_s", _secs),
    ("queueing delay p99", "queue_p99_s", _secs),
    ("time to first token p50", "ttft_p50_s", _secs),
    ("time to first token p99", "ttft_p99_s", _secs),
    ("time per output token p50", "tpot_p50_s", _secs),
    ("time per output token p99", "tpot_p99_s", _secs),
    ("end-to-end latency p50", "latency_p50_s", _secs),
    ("end-to-end latency p99", "latency_p99_s", _secs),
    ("goodput (meet TTFT & TPOT)", "goodput", _pct),
    ("makespan (simulated)", "makespan_s", _secs),
    ("engine steps", "steps", _num),
]


_CONTIG_LABEL = {
    "max": "contiguous (max-length)",
    "pow2": "contiguous (pow2)",
    "oracle": "contiguous (oracle)",
}


def format_simulation(
    workload_name: str,
    wstats: Dict[str, float],
    bill: MemoryBill,
    cfg_desc: str,
    paged: SimResult,
    contiguous: Union[SimResult, Sequence[SimResult], None],
    all_full: Optional[SimResult] = None,
    all_full_bill: Optional[MemoryBill] = None,
    waste_split: bool = False,
) -> str:
    """The human-readable report (``all_full``: the same replay with every window and chunk
    layer billed as full attention, in ``all_full_bill``'s pool; ``contiguous``: one or more
    contiguous baselines, a column each; ``waste_split``: a line per baseline splitting its
    waste into reserved, internal and external fragmentation)."""
    if contiguous is None:
        contigs: List[SimResult] = []
    elif isinstance(contiguous, SimResult):
        contigs = [contiguous]
    else:
        contigs = list(contiguous)
    m = bill.model
    out: List[str] = []
    out.append(
        f"workload  {workload_name}: {int(wstats['requests']):,} requests ({int(wstats['sequences']):,} sequences), "
        f"{int(wstats['prompt_tokens']):,} prompt + {int(wstats['output_tokens']):,} output tokens "
        f"over {wstats['span_s']:,.1f} s"
    )
    out.append(
        f"model     {m.name}: KV {fmt_bytes(bill.kv_bytes_per_token)}/token = {m.kv_formula()}"
    )
    out.append(
        f"memory    {fmt_bytes(bill.gpu_bytes)} GPU - {fmt_bytes(bill.weight_bytes)} weights - "
        f"{fmt_bytes(bill.reserve_bytes)} reserve = {bill.num_blocks:,} blocks x {bill.block_size} tokens "
        f"({fmt_bytes(bill.num_blocks * bill.block_bytes)}, {bill.token_slots:,} token slots)"
    )
    out.extend(bill_lines(bill))
    out.append(f"engine    {cfg_desc}")
    out.append("")
    cols = [("", 27), ("paged (kvblocks)", 18)]
    if all_full is not None:
        cols.append(("paged, all layers full", 24))
    for c in contigs:
        cols.append((_CONTIG_LABEL[c.summary.get("policy", "max")], 24))
    out.append("".join(f"{t:<{w}}" if i == 0 else f"{t:>{w}}" for i, (t, w) in enumerate(cols)))
    for label, key, fmt in ROWS:
        line = f"{label:<27}{fmt(paged.summary.get(key)):>18}"
        if all_full is not None:
            line += f"{fmt(all_full.summary.get(key)):>24}"
        for c in contigs:
            line += f"{fmt(c.summary.get(key)):>24}"
        out.append(line)
    out.append("")
    ps = paged.summary
    usage = usage_lines(ps)
    if usage:
        out.extend(usage)
        out.append("")
    if all_full is not None and all_full_bill is not None:
        out.append(gain_line(hybrid_gain(ps, all_full.summary), bill, all_full_bill))
    for c in contigs:
        cs = c.summary
        policy = cs.get("policy", "max")
        gain = (
            ps["throughput_tok_s"] / cs["throughput_tok_s"]
            if cs["throughput_tok_s"]
            else float("inf")
        )
        if policy == "max":
            out.append(
                f"contiguous reserves {cs['max_len']:,} tokens per sequence ({cs['regions']:,} regions fit); "
                f"paging serves {gain:.2f}x its throughput."
            )
        else:
            how = ("the next power of two of its length" if policy == "pow2"
                   else "exactly its final length")  # fmt: skip
            out.append(
                f"contiguous {policy} reserves {how} (first fit; {cs['preemptions']:,} preemptions"
                f"{', %s regrowth copies' % format(cs['regrow_copies'], ',') if policy == 'pow2' else ''}); "
                f"paging serves {gain:.2f}x its throughput."
            )
        if waste_split:
            out.append(
                f"  {policy} waste: {100 * cs['waste_reserved']:.1f}% reserved + "
                f"{100 * cs['waste_internal']:.1f}% internal fragmentation of allocated slots; "
                f"{100 * cs['waste_external']:.1f}% of the pool externally fragmented"
            )
    out.append(
        f"allocator: {ps['allocator_s']:.2f} s of {ps['wall_s']:.2f} s replay wall time "
        f"({100.0 * ps['allocator_share']:.1f}%) inside BlockManager calls; "
        f"{ps['block_hits']:,} blocks served from the prefix cache; pool.check() passed, every block free at the end."
    )
    return "\n".join(out)


def simulation_json(
    workload_name: str,
    wstats: Dict[str, float],
    bill: MemoryBill,
    config: Dict[str, Any],
    time_model: Dict[str, float],
    paged: SimResult,
    contiguous: Optional[SimResult],
    all_full: Optional[SimResult] = None,
    all_full_bill: Optional[MemoryBill] = None,
    extra: Optional[Dict[str, Any]] = None,
    contiguous_policies: Optional[Sequence[SimResult]] = None,
) -> str:
    """The machine-readable report (one JSON object); with ``all_full``, also its summary,
    its memory bill and ``hybrid_gain`` (hybrid / all-full ratios); ``extra`` keys first."""
    doc: Dict[str, Any] = {
        **(extra or {}),
        "workload": dict(wstats, name=workload_name),
        "memory": bill.as_dict(),
        "config": config,
        "time_model": time_model,
        "paged": paged.summary,
        "contiguous": contiguous.summary if contiguous is not None else None,
    }
    if all_full is not None and all_full_bill is not None:
        doc["all_full"] = all_full.summary
        doc["memory_all_full"] = all_full_bill.as_dict()
        doc["hybrid_gain"] = hybrid_gain(paged.summary, all_full.summary)
    if contiguous_policies is not None:  # --contiguous: every policy replayed, by name
        doc["contiguous_policies"] = {
            c.summary.get("policy", "max"): c.summary for c in contiguous_policies
        }
    return json.dumps(json_safe(doc), indent=2)
