"""``kvblocks plan``: how many sequences fit, paged versus contiguous, and the bill per token.

Length distributions (``DIST``), in tokens:

* ``2048`` or ``const:2048``: always that length;
* ``uniform:LO:HI``: integers uniform in [LO, HI];
* ``normal:MEAN:STD``: normal, rounded;
* ``lognormal:MEAN:STD``: log-normal with that mean and standard deviation of the length
  itself (not of its logarithm), rounded: the long-tailed shape real traffic has.

Draws are clipped to [1, the model's context length]. The plan draws ``samples`` prompt and
output lengths (seeded, so reproducible) and compares, in the same KV memory:

* **paged**: each sequence holds ``ceil((prompt + output) / block_size)`` blocks at its end;
  the only waste is the empty tail of its last block (block rounding);
* **paged, steady state**: sequences are spread over their lifetime, so on average half of
  the output is written: what a busy server actually holds;
* **contiguous**: each sequence reserves the maximum length up front (``--max-len``, by
  default the largest prompt + output drawn).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from .. import limits
from ..errors import SimulationError
from ..limits import MAX_TOKENS
from ..models.spec import MemoryBill, ModelSpec
from ..report.fmt import fmt_bytes, json_safe
from ..report.groups import bill_lines

__all__ = ["LengthDist", "parse_dist", "Plan", "make_plan", "format_plan", "DIST_HELP"]

DIST_HELP = (
    "DIST is a length in tokens: N | const:N | uniform:LO:HI | normal:MEAN:STD | "
    "lognormal:MEAN:STD (mean and std of the length itself); draws are rounded and clipped to "
    "[1, model context]"
)


@dataclass(frozen=True)
class LengthDist:
    """A distribution of token lengths."""

    kind: str
    params: Tuple[float, ...]
    text: str

    def sample(self, rng: np.random.Generator, n: int, hi: int) -> np.ndarray:
        """``n`` int64 draws clipped to [1, hi]."""
        k, p = self.kind, self.params
        if k == "const":
            x = np.full(n, p[0])
        elif k == "uniform":
            x = rng.integers(int(p[0]), int(p[1]) + 1, size=n)
        elif k == "normal":
            x = rng.normal(p[0], p[1], size=n)
        else:  # lognormal, from the mean and std of the length
            mean, std = p
            sigma2 = math.log1p((std / mean) ** 2)
            x = rng.lognormal(math.log(mean) - sigma2 / 2.0, math.sqrt(sigma2), size=n)
        return np.clip(np.rint(x), 1, hi).astype(np.int64)


def parse_dist(text: str, what: str = "length") -> LengthDist:
    """Parse DIST syntax (see module docstring); SimulationError names ``what`` on bad input."""
    raw = text.strip()
    parts = raw.split(":")
    kind = parts[0].lower() if len(parts) > 1 else "const"
    args = parts[1:] if len(parts) > 1 else parts
    arity = {"const": 1, "uniform": 2, "normal": 2, "lognormal": 2}
    if kind not in arity:
        raise SimulationError(f"{what}: unknown distribution {parts[0]!r} in {text!r}; {DIST_HELP}")
    if len(args) != arity[kind]:
        raise SimulationError(
            f"{what}: {kind} takes {arity[kind]} number(s), got {text!r}; {DIST_HELP}"
        )
    try:
        vals = tuple(float(a) for a in args)
    except ValueError:
        raise SimulationError(f"{what}: not a number in {text!r}; {DIST_HELP}") from None
    if any(not math.isfinite(v) for v in vals):
        raise SimulationError(f"{what}: {text!r} must use finite numbers")
    if any(v > MAX_TOKENS for v in vals):
        raise SimulationError(f"{what}: {text!r} is absurdly long (limit {MAX_TOKENS:,} tokens)")
    if kind in ("const", "uniform") and any(v < 1 or v != int(v) for v in vals):
        raise SimulationError(f"{what}: {text!r} needs whole lengths >= 1")
    if kind == "uniform" and vals[0] > vals[1]:
        raise SimulationError(f"{what}: {text!r} has LO > HI")
    if kind in ("normal", "lognormal") and (vals[0] < 1 or vals[1] < 0):
        raise SimulationError(f"{what}: {text!r} needs MEAN >= 1 and STD >= 0")
    return LengthDist(kind, vals, raw)


@dataclass
class Plan:
    """The capacity plan's numbers."""

    bill: MemoryBill
    prompt: LengthDist
    output: LengthDist
    samples: int
    max_len: int
    numbers: Dict[str, float]

    def as_dict(self) -> Dict[str, object]:
        return {
            "memory": self.bill.as_dict(),
            "prompt_len": self.prompt.text,
            "output_len": self.output.text,
            "samples": self.samples,
            "contiguous_max_len": self.max_len,
            **self.numbers,
        }


def make_plan(
    bill: MemoryBill,
    prompt: LengthDist,
    output: LengthDist,
    max_len: Optional[int] = None,
    samples: int = 100_000,
    seed: int = 0,
    all_full: Optional[MemoryBill] = None,
) -> Plan:
    """Draw lengths and count what fits under paging and under contiguous reservation.

    A hybrid model's sequence holds :meth:`MemoryBill.seq_blocks` blocks (window and chunk
    groups only what the next query reads, state groups their blocks); ``all_full``, the
    same model billed with every layer as full attention, adds the baseline's figures and
    ``hybrid_gain`` (sequences that fit, hybrid over all-full)."""
    samples = limits.SAMPLES.check_int(samples)
    seed = limits.SEED.check_int(seed)
    if max_len is not None:
        max_len = limits.MAX_LEN.check_int(max_len)
    model: ModelSpec = bill.model
    rng = np.random.default_rng(seed)
    p = prompt.sample(rng, samples, model.max_context)
    o = output.sample(rng, samples, model.max_context)
    total = p + o
    bs = bill.block_size
    lay = bill.groups
    blocks = bill.seq_blocks(total)
    exact = lay.live_slots(total)  # slots with no rounding (= total for one full group)
    waste = blocks * bs - exact
    live = (
        p + np.floor(rng.random(samples) * o).astype(np.int64) + 1
    )  # mid-life: part of the output written
    live_blocks = bill.seq_blocks(live)
    reserve = int(total.max()) if max_len is None else max_len
    region = lay.live_slots(reserve)  # contiguous: window and chunk layers as rings
    slots = bill.token_slots
    kvb = bill.block_bytes / bs  # bytes per slot (= KV bytes per token for one full group)
    mean_tokens = float(total.mean())
    mean_exact = float(np.mean(exact))
    paged_full = int(bill.num_blocks // blocks.mean())
    paged_steady = int(bill.num_blocks // live_blocks.mean())
    contiguous = int(slots // region)
    too_long = float((total > reserve).mean())
    ideal = int(slots // mean_exact)
    n = {
        "mean_prompt": float(p.mean()),
        "mean_output": float(o.mean()),
        "mean_tokens": mean_tokens,
        "p99_tokens": float(np.percentile(total, 99)),
        "max_tokens": int(total.max()),
        "mean_blocks": float(blocks.mean()),
        "mean_rounding_tokens": float(waste.mean()),
        "rounding_share": float(waste.sum() / (blocks.sum() * bs)),
        "paged_concurrent": paged_full,
        "paged_concurrent_steady": paged_steady,
        "contiguous_concurrent": contiguous,
        "ideal_concurrent": ideal,
        "contiguous_waste_share": 1.0 - mean_exact / region,
        "contiguous_too_long_share": too_long,
        "gain": paged_full / contiguous if contiguous else float("inf"),
        # bytes of GPU memory per live token when the KV pool is full of such sequences
        "bill_weights_per_token": (bill.weight_bytes + bill.reserve_bytes)
        / max(1.0, paged_full * mean_tokens),
        "bill_kv_per_token": kvb * mean_exact / mean_tokens,
        "bill_rounding_per_token": kvb * float(waste.mean()) / mean_tokens,
        "bill_contiguous_waste_per_token": kvb * (region - mean_exact) / mean_tokens,
    }
    if lay.hybrid:
        q0 = np.maximum(total - 1, 0)
        n["groups"] = [
            {
                "kind": sh.group.kind,
                "span": sh.group.span,
                "kvblocks_groups": sh.copies,
                "mean_blocks_per_seq": float(sh.copies * sh.held_blocks(total, q0, bs).mean()),
            }
            for sh in lay.shares
        ]
    if all_full is not None:
        base_blocks = all_full.seq_blocks(total).mean()
        base_full = int(all_full.num_blocks // base_blocks)
        base_steady = int(all_full.num_blocks // all_full.seq_blocks(live).mean())
        n["all_full_paged_concurrent"] = base_full
        n["all_full_paged_concurrent_steady"] = base_steady
        n["all_full_bytes_per_seq"] = float(base_blocks * all_full.block_bytes)
        n["hybrid_bytes_per_seq"] = float(blocks.mean() * bill.block_bytes)
        n["hybrid_gain"] = paged_full / base_full if base_full else float("inf")
        n["hybrid_gain_steady"] = paged_steady / base_steady if base_steady else float("inf")
    return Plan(bill, prompt, output, samples, reserve, n)


def format_plan(plan: Plan) -> str:
    """The human-readable plan."""
    b, n, m = plan.bill, plan.numbers, plan.bill.model
    lines: List[str] = []
    lines.append(
        f"plan      {m.name} on {fmt_bytes(b.gpu_bytes)} GPU memory, {b.block_size}-token blocks"
    )
    lines.append(
        f"lengths   prompt {plan.prompt.text} (mean {n['mean_prompt']:,.0f}), output {plan.output.text} "
        f"(mean {n['mean_output']:,.0f}); prompt+output mean {n['mean_tokens']:,.0f}, p99 {n['p99_tokens']:,.0f}, "
        f"max {n['max_tokens']:,} ({plan.samples:,} draws)"
    )
    lines.append("")
    lines.append("memory bill")
    lines.append(f"  GPU memory              {fmt_bytes(b.gpu_bytes):>12}")
    lines.append(
        f"  - weights               {fmt_bytes(b.weight_bytes):>12}   {m.params / 1e9:.2f}B params x {m.weight_dtype}"
    )
    lines.append(f"  - reserve               {fmt_bytes(b.reserve_bytes):>12}   {b.reserve_note}")
    lines.append(
        f"  = KV pool               {fmt_bytes(b.kv_pool_bytes):>12}   {b.num_blocks:,} blocks, {b.token_slots:,} token slots"
    )
    lines.append(
        f"  KV per token            {fmt_bytes(b.kv_bytes_per_token):>12}   {m.kv_formula()}"
    )
    lines.append(
        f"  KV per block            {fmt_bytes(b.block_bytes):>12}   {b.block_size} tokens"
    )
    for line in bill_lines(b):
        lines.append("  " + line)
    lines.append("")
    lines.append("concurrent sequences that fit")
    lines.append(f"  paged, all at full length        {n['paged_concurrent']:>9,}")
    lines.append(f"  paged, steady state (mid-life)   {n['paged_concurrent_steady']:>9,}")
    lines.append(
        f"  contiguous max-length            {n['contiguous_concurrent']:>9,}   reserves {plan.max_len:,} tokens each"
        + (
            f"; {100 * n['contiguous_too_long_share']:.1f}% of draws exceed it"
            if n["contiguous_too_long_share"]
            else ""
        )
    )
    lines.append(f"  ideal (no waste at all)          {n['ideal_concurrent']:>9,}")
    if "all_full_paged_concurrent" in n:
        lines.append(
            f"  paged, all layers full           {n['all_full_paged_concurrent']:>9,}   "
            f"{fmt_bytes(n['all_full_bytes_per_seq'])} per sequence vs {fmt_bytes(n['hybrid_bytes_per_seq'])} hybrid"
        )
        lines.append(
            f"  hybrid / all layers full         {n['hybrid_gain']:>9.2f}x   "
            f"(steady state {n['hybrid_gain_steady']:.2f}x)"
        )
    gain = n["gain"]
    lines.append(
        f"  paged / contiguous               {gain:>9.2f}x"
        if math.isfinite(gain)
        else "  paged / contiguous                     inf"
    )
    lines.append("")
    lines.append("bill per live token (pool full of such sequences)")
    lines.append(f"  weights + reserve share       {fmt_bytes(n['bill_weights_per_token']):>12}")
    lines.append(f"  KV                            {fmt_bytes(n['bill_kv_per_token']):>12}")
    lines.append(
        f"  block rounding (paged)        {fmt_bytes(n['bill_rounding_per_token']):>12}   "
        f"{n['mean_rounding_tokens']:.1f} empty slots per sequence, {100 * n['rounding_share']:.2f}% of its blocks"
    )
    lines.append(
        f"  over-reservation (contiguous) {fmt_bytes(n['bill_contiguous_waste_per_token']):>12}   "
        f"{100 * n['contiguous_waste_share']:.1f}% of each reservation unused at the end"
    )
    return "\n".join(lines)


def plan_json(plan: Plan) -> str:
    """The machine-readable plan."""
    return json.dumps(json_safe(plan.as_dict()), indent=2)
