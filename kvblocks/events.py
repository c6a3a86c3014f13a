"""KV events for cluster routers, with the fields vLLM publishes.

Recording is off by default (``BlockPool(..., enable_kv_events=True)`` or
``pool.record_events = True``); ``pool.take_events()`` drains them. Hashes are 128-bit ints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

__all__ = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEvent"]


@dataclass
class BlockStored:
    """Full blocks registered in the prefix cache, a chain: ``block_hashes[0]`` chains on
    ``parent_block_hash`` (the sequence's salted root for a first block)."""

    block_hashes: List[int]
    parent_block_hash: Optional[int]
    token_ids: List[int]
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = "GPU"


@dataclass
class BlockRemoved:
    """Cache entries dropped (evicted on reuse, or invalidated)."""

    block_hashes: List[int] = field(default_factory=list)
    medium: Optional[str] = "GPU"


@dataclass
class AllBlocksCleared:
    """reset_prefix_cache() dropped every entry."""


KVEvent = (BlockStored, BlockRemoved, AllBlocksCleared)
