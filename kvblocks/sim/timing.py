"""The per-step time model of a continuous-batching engine.

One engine step runs every scheduled token through the model once::

    step = overhead + prefill_tokens x prefill_cost + decode_tokens x decode_cost
           + kv_tokens_read x kv_read_cost + swapped_bytes / swap_bandwidth

Defaults are first-order numbers for one H100-SXM-class GPU (989 dense bf16 TFLOP/s,
3.35 TB/s HBM), derived from the model:

* ``overhead``: reading every weight once per step at 80% of HBM bandwidth, plus 1 ms of
  host-side scheduling and kernel launches;
* ``prefill_cost`` and ``decode_cost``: ``2 x active parameters`` FLOPs per token at 50% of
  peak (attention FLOPs of long prompts are ignored);
* ``kv_read_cost``: a decoding token's attention reads every cached token of its sequence
  once: ``KV bytes per token`` at 80% of HBM bandwidth; in a hybrid model a window layer
  reads at most its window, a chunk layer its current chunk and a state layer its state
  (:meth:`TimeModel.kv_tokens_read`), whether or not the KV cache keeps more;
* swap and host-tier copies: 25 GB/s, effective PCIe Gen4 x16 (``--pcie-gbps``; see
  :mod:`kvblocks.sim.hosttier`).

Every constant is overridable from the command line; the point is the memory bill, and this
model only has to rank schedules sensibly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Tuple

import numpy as np

from . import limits
from .models import ModelSpec

__all__ = ["TimeModel", "PEAK_FLOPS", "HBM_BYTES_PER_S"]

PEAK_FLOPS = 989e12
HBM_BYTES_PER_S = 3.35e12
COMPUTE_EFFICIENCY = 0.5
BANDWIDTH_EFFICIENCY = 0.8
HOST_OVERHEAD_S = 1e-3
SWAP_BYTES_PER_S = 25e9


@dataclass(frozen=True)
class TimeModel:
    """Seconds per engine step as a linear function of the work in it."""

    step_overhead_s: float
    prefill_s_per_token: float
    decode_s_per_token: float
    kv_read_s_per_token: float
    swap_bytes_per_s: float = SWAP_BYTES_PER_S
    # hybrid models: (kind, span, share of the per-token bytes) per attention kind, and the
    # state a decoding token reads, in tokens' worth of KV (see kv_tokens_read); () = full
    read_kinds: Tuple[Tuple[str, int, float], ...] = ()
    state_read_tokens: float = 0.0

    @property
    def windowed_reads(self) -> bool:
        """Whether reads depend on more than the context length (hybrid models)."""
        return bool(self.read_kinds)

    def kv_tokens_read(self, ctx: Any) -> float:
        """Tokens' worth of KV the decoding sequences of context lengths ``ctx`` read in one
        step: a full layer reads the whole context, a window layer at most its window, a
        chunk layer the current chunk so far, a state layer its state."""
        if not self.read_kinds:
            return int(np.sum(ctx))
        c = np.asarray(ctx, dtype=np.int64)
        total = self.state_read_tokens * c.size
        for kind, span, share in self.read_kinds:
            if kind == "sliding_window":
                total += share * float(np.minimum(c, span).sum())
            elif kind == "chunked_local":
                total += share * float(((c - 1) % span + 1).sum())
            else:
                total += share * float(c.sum())
        return total

    @classmethod
    def for_model(
        cls,
        model: ModelSpec,
        step_overhead_ms: Optional[float] = None,
        prefill_us: Optional[float] = None,
        decode_us: Optional[float] = None,
        kv_read_ns: Optional[float] = None,
    ) -> "TimeModel":
        """Defaults from the model (see module docstring), each overridable."""
        for lim, v in ((limits.STEP_OVERHEAD_MS, step_overhead_ms), (limits.PREFILL_US, prefill_us),
                       (limits.DECODE_US, decode_us), (limits.KV_READ_NS, kv_read_ns)):  # fmt: skip
            if v is not None:
                lim.check(v)
        flops_token = 2.0 * model.active_params / (PEAK_FLOPS * COMPUTE_EFFICIENCY)
        overhead = model.weight_bytes / (HBM_BYTES_PER_S * BANDWIDTH_EFFICIENCY) + HOST_OVERHEAD_S
        kv_read = model.kv_bytes_per_token / (HBM_BYTES_PER_S * BANDWIDTH_EFFICIENCY)
        kinds: Tuple[Tuple[str, int, float], ...] = ()
        state = 0.0
        if model.hybrid:
            kinds = tuple(model.read_weights())
            state = model.state_bytes_per_seq / model.kv_bytes_per_token
        return cls(
            step_overhead_s=overhead if step_overhead_ms is None else step_overhead_ms * 1e-3,
            prefill_s_per_token=flops_token if prefill_us is None else prefill_us * 1e-6,
            decode_s_per_token=flops_token if decode_us is None else decode_us * 1e-6,
            kv_read_s_per_token=kv_read if kv_read_ns is None else kv_read_ns * 1e-9,
            read_kinds=kinds,
            state_read_tokens=state,
        )

    def step(
        self,
        prefill_tokens: int,
        decode_tokens: int,
        kv_tokens_read: float,
        swap_bytes: int = 0,
    ) -> float:
        """Seconds one step takes."""
        return (
            self.step_overhead_s
            + prefill_tokens * self.prefill_s_per_token
            + decode_tokens * self.decode_s_per_token
            + kv_tokens_read * self.kv_read_s_per_token
            + swap_bytes / self.swap_bytes_per_s
        )

    def as_dict(self) -> Dict[str, float]:
        d = asdict(self)
        return {
            "step_overhead_ms": d["step_overhead_s"] * 1e3,
            "prefill_us_per_token": d["prefill_s_per_token"] * 1e6,
            "decode_us_per_token": d["decode_s_per_token"] * 1e6,
            "kv_read_ns_per_token": d["kv_read_s_per_token"] * 1e9,
            "swap_gb_per_s": d["swap_bytes_per_s"] / 1e9,
        }
