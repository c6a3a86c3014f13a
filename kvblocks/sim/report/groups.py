"""Report lines for hybrid models: the bill per layer kind, usage per group, the gain over
treating every layer as full attention.

>>> hybrid_gain({"peak_concurrency": 30, "mean_concurrency": 20.0, "throughput_tok_s": 900.0,
...              "prefix_hit_rate": 0.5}, {"peak_concurrency": 10, "mean_concurrency": 10.0,
...              "throughput_tok_s": 300.0, "prefix_hit_rate": 0.25})["throughput_tok_s"]
3.0
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from ..models.spec import MemoryBill
from .fmt import fmt_bytes

__all__ = ["GAIN_KEYS", "hybrid_gain", "bill_lines", "usage_lines", "gain_line"]

#: the figures whose hybrid / all-full ratio the reports give
GAIN_KEYS = ("peak_concurrency", "mean_concurrency", "throughput_tok_s", "prefix_hit_rate")


def hybrid_gain(hybrid: Dict[str, Any], all_full: Dict[str, Any]) -> Dict[str, Optional[float]]:
    """``hybrid / all_full`` for each of :data:`GAIN_KEYS` (None where the baseline is 0)."""
    out: Dict[str, Optional[float]] = {}
    for k in GAIN_KEYS:
        b = float(all_full.get(k) or 0.0)
        out[k] = float(hybrid.get(k) or 0.0) / b if b else None
    return out


def _kind(g: Dict[str, Any]) -> str:
    if g["kind"] == "full":
        return "full"
    if g["kind"] == "state":
        return "state"
    return f"{g['kind']} {g['span']:,}"


def bill_lines(bill: MemoryBill) -> List[str]:
    """One line per layer kind: groups, bytes per token, what a sequence holds at most."""
    lay = bill.groups
    if not lay.hybrid and not bill.model.hybrid:
        return []
    head = (
        f"groups    {lay.num_groups} kvblocks groups of {lay.layers_per_group} layers, "
        f"{fmt_bytes(bill.block_bytes)} per block"
        + (" (window and chunk layers billed as full attention)" if lay.all_full else "")
    )
    out = [head]
    for g in bill.group_bill():
        line = f"  {_kind(g):<22} {g['layers']:>3} layers = {g['kvblocks_groups']:>3} x {g['layers_per_group']}: "
        if g["kind"] == "state":
            line += (
                f"{g['blocks_per_seq']:,} blocks = {fmt_bytes(g['bytes_per_seq'])} per sequence "
                f"(state {fmt_bytes(g['state_bytes_per_seq_exact'])}, rounded up to blocks)"
            )
        elif g["kind"] == "full":
            line += f"{fmt_bytes(g['bytes_per_token'])} per token, every token"
        else:
            line += (
                f"{fmt_bytes(g['bytes_per_token'])} per token, at most {g['max_tokens_held']:,} "
                f"tokens ({g['max_blocks_per_seq']:,} blocks) per sequence"
            )
        out.append(line)
    return out


def usage_lines(summary: Dict[str, Any], label: str = "") -> List[str]:
    """Peak and time-weighted mean blocks held per layer kind (all its groups together)."""
    groups = summary.get("groups")
    if not groups:
        return []
    out = [f"blocks held per layer kind{label} (sequences' tables; shared blocks count per holder)"]
    for g in groups:
        out.append(
            f"  {_kind(g):<22} {g['kvblocks_groups']:>3} groups: peak {g['peak_blocks']:>10,} "
            f"({g['peak_gib']:.2f} GiB), mean {g['mean_blocks']:>12,.1f} ({g['mean_gib']:.2f} GiB)"
        )
    return out


def gain_line(gain: Dict[str, Optional[float]], hybrid: MemoryBill, base: MemoryBill) -> str:
    """The hybrid layout against the all-full baseline, in words."""

    def r(k: str) -> str:
        v = gain.get(k)
        return "-" if v is None else f"{v:.2f}x"

    return (
        f"hybrid groups vs all layers full ({hybrid.num_blocks:,} vs {base.num_blocks:,} blocks of "
        f"{fmt_bytes(hybrid.block_bytes)} vs {fmt_bytes(base.block_bytes)}): peak concurrency "
        f"{r('peak_concurrency')}, mean concurrency {r('mean_concurrency')}, throughput "
        f"{r('throughput_tok_s')}, prefix hit rate {r('prefix_hit_rate')}"
    )
