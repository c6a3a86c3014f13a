"""What both replays share about continuous batching: the engine's knobs and one step's budget.

:class:`SchedulerConfig` holds the modelled engine's settings (vLLM's defaults).
:class:`StepBudget` is one engine step's token budget (``max_num_batched_tokens``): decoding
sequences take one token each, then running prompts and newly admitted ones take chunks of
what is left (chunked prefill), in order, until it runs out. The paged replay
(:mod:`kvblocks.sim.engine.paged`) and the contiguous one (:mod:`kvblocks.sim.engine.contiguous`) both
chunk prompts with :meth:`StepBudget.take_chunk`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from .. import limits
from ..errors import SimulationError
from ..models.hybrid import GroupLayout

__all__ = ["SchedulerConfig", "StepBudget"]


@dataclass(frozen=True)
class SchedulerConfig:
    """Knobs of the modelled engine (defaults follow vLLM's)."""

    num_blocks: int  # usable KV blocks (the null block comes on top)
    block_size: int = 16
    enable_prefix_caching: bool = True
    watermark: float = 0.01  # fraction of blocks admission keeps free (vLLM v0 default)
    max_num_seqs: int = 256  # sequences per batch
    token_budget: int = 8192  # tokens per step (max_num_batched_tokens)
    preemption: str = "recompute"  # or "swap"
    host_write_through: bool = False  # host tier: copy each cached block to the host at once
    host_blocks: int = 0  # swap space in blocks
    block_bytes: int = 0  # bytes per block (swap and host-tier transfer time)
    host_cache_blocks: int = 0  # host prefix-cache tier in blocks (0: none; needs the core's tier)
    layout: Optional[GroupLayout] = None  # hybrid models: layers -> kvblocks groups (None: one)
    slo_ttft_s: float = 2.0  # goodput: a request meets TTFT <= this ...
    slo_tpot_s: float = 0.1  # ... and time per output token <= this

    @property
    def kv_groups(self) -> Any:
        """The ``groups=`` of the BlockManager (None: the default single full group)."""
        lay = self.layout
        return lay.kvgroups if lay is not None and lay.hybrid else None

    def as_dict(self) -> dict:
        """The knobs as JSON values (the layout as its per-kind list)."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "layout"}
        d["groups"] = self.layout.as_list() if self.layout is not None else None
        return d

    def validate(self) -> None:
        if self.preemption not in ("recompute", "swap"):
            raise SimulationError(
                f"--preemption must be 'recompute' or 'swap', got {self.preemption!r}"
            )
        limits.WATERMARK.check(self.watermark)
        limits.MAX_NUM_SEQS.check(self.max_num_seqs)
        limits.TOKEN_BUDGET.check(self.token_budget)
        if self.host_cache_blocks < 0:
            raise SimulationError(f"host_cache_blocks must be >= 0, got {self.host_cache_blocks}")
        if self.host_cache_blocks and not self.enable_prefix_caching:
            raise SimulationError("--host-cache is a prefix-cache tier: drop --no-prefix-caching")
        if self.host_write_through and not self.host_cache_blocks:
            raise SimulationError("--host-write-through needs a host tier (--host-cache GiB > 0)")


class StepBudget:
    """The tokens one engine step may still compute, and the prefill work given out so far."""

    __slots__ = ("left", "prefill_tokens", "completed", "chunks")

    def __init__(self, tokens: int) -> None:
        self.left = tokens  # tokens still to give out (the decodes' tokens already taken)
        self.prefill_tokens = 0  # prompt tokens given out as chunks
        self.completed: List[Any] = []  # prompts whose last chunk is in this step, in order
        self.chunks: List[Tuple[int, int]] = []  # (first position, tokens) of each chunk

    def take_chunk(self, s: Any) -> None:
        """Give ``s`` (anything with a ``prefill_left`` count; with ``prompt_len`` and ``gen``
        the chunk's first position is known, else it counts from 0) its next prefill chunk."""
        c = s.prefill_left if s.prefill_left < self.left else self.left
        if c > 0:
            total = getattr(s, "prompt_len", s.prefill_left) + getattr(s, "gen", 0)
            self.chunks.append((total - s.prefill_left, c))
        s.prefill_left -= c
        self.left -= c
        self.prefill_tokens += c
        if s.prefill_left == 0:
            self.completed.append(s)
