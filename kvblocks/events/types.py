"""KV cache event types, with the fields vLLM publishes, and the rule that groups them.

Recording is off by default (``BlockPool(..., enable_kv_events=True)`` or
``pool.record_events = True``); ``pool.take_events()`` drains them. Hashes are kvblocks'
128-bit ints; :func:`kvblocks.events.encode_batch` folds them to the 64-bit ints vLLM puts on
the wire.

Grouping: consecutive stored blocks that chain on each other (each block's parent is the
previous block's hash) come as one :class:`BlockStored`, and consecutive removals as one
:class:`BlockRemoved`, the way vLLM publishes them. ``take_events()`` applies the rule to one
drain; :func:`coalesce` applies it again across drains (several pools' or steps' events
concatenated into one batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple, Union

from ..errors import InvalidTypeError

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEvent", "coalesce"]


@dataclass
class BlockStored:
    """Full blocks registered in the prefix cache, a chain: ``block_hashes[0]`` chains on
    ``parent_block_hash``, which is None for the first block of a sequence.

    ``token_ids`` holds exactly ``len(block_hashes) * block_size`` tokens. ``lora_name`` and
    ``lora_id`` name the adapter the blocks were computed with (None: the base model);
    ``group_idx`` is the KV cache group; ``kv_cache_spec_kind`` its kind in vLLM's terms
    (``"full_attention"``, ``"sliding_window"``, ``"chunked_local_attention"``, ``"mamba"``)
    and ``kv_cache_spec_sliding_window`` its window (None unless a sliding window).
    ``extra_keys`` holds one entry per block, vLLM's event extra keys: None for a block
    without, else a tuple of the adapter name (every block of a LoRA request) and the cache
    salt (a chain's first block only), in that order; ``extra_keys=None`` means none on any
    block (the wire carries one nil per block).
    """

    block_hashes: List[int]
    parent_block_hash: Optional[int]
    token_ids: List[int]
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = "GPU"
    lora_name: Optional[str] = None
    group_idx: int = 0
    kv_cache_spec_kind: Optional[str] = "full_attention"
    kv_cache_spec_sliding_window: Optional[int] = None
    extra_keys: Optional[List[Optional[Tuple[Any, ...]]]] = None


@dataclass
class BlockRemoved:
    """Cache entries dropped (evicted on reuse, or invalidated)."""

    block_hashes: List[int] = field(default_factory=list)
    medium: Optional[str] = "GPU"
    group_idx: int = 0


@dataclass
class AllBlocksCleared:
    """reset_prefix_cache() dropped every entry."""


KVEvent = (BlockStored, BlockRemoved, AllBlocksCleared)
AnyEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


def coalesce(events: Sequence[AnyEvent]) -> List[AnyEvent]:
    """Merge neighbours that one event can carry, in order: a BlockStored whose parent is
    the last hash of the BlockStored before it (same block size, medium, adapter and group),
    and a BlockRemoved following a BlockRemoved of the same medium and group.

    Returns a new list of new events; the inputs are not modified.
    """
    out: List[AnyEvent] = []
    for ev in events:
        last = out[-1] if out else None
        if isinstance(ev, BlockStored):
            if (
                isinstance(last, BlockStored)
                and last.block_hashes
                and ev.parent_block_hash is not None
                and last.block_hashes[-1] == ev.parent_block_hash
                and (last.block_size, last.medium, last.lora_id, last.lora_name, last.group_idx)
                == (ev.block_size, ev.medium, ev.lora_id, ev.lora_name, ev.group_idx)
            ):
                if last.extra_keys is not None or ev.extra_keys is not None:
                    last.extra_keys = _extra(last) + _extra(ev)
                last.block_hashes.extend(ev.block_hashes)
                last.token_ids.extend(ev.token_ids)
                continue
            out.append(
                BlockStored(
                    list(ev.block_hashes),
                    ev.parent_block_hash,
                    list(ev.token_ids),
                    ev.block_size,
                    ev.lora_id,
                    ev.medium,
                    ev.lora_name,
                    ev.group_idx,
                    ev.kv_cache_spec_kind,
                    ev.kv_cache_spec_sliding_window,
                    None if ev.extra_keys is None else list(ev.extra_keys),
                )
            )
        elif isinstance(ev, BlockRemoved):
            if (
                isinstance(last, BlockRemoved)
                and last.medium == ev.medium
                and last.group_idx == ev.group_idx
            ):
                last.block_hashes.extend(ev.block_hashes)
                continue
            out.append(BlockRemoved(list(ev.block_hashes), ev.medium, ev.group_idx))
        elif isinstance(ev, AllBlocksCleared):
            out.append(AllBlocksCleared())
        else:
            raise InvalidTypeError(f"coalesce: not a KV event: {type(ev).__name__}")
    return out


def _extra(ev: BlockStored) -> List[Optional[Tuple[Any, ...]]]:
    """A stored event's extra keys, one entry per block."""
    return list(ev.extra_keys) if ev.extra_keys is not None else [None] * len(ev.block_hashes)
