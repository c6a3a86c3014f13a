"""transformers' ``CachePool`` (its block pool) backed by a :class:`kvblocks.BlockPool`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional

import numpy as np

from ... import BlockManager, BlockPool, KVGroup
from ...errors import InvalidStateError
from . import context
from .compat import CachePool

if TYPE_CHECKING:  # annotations only
    from .allocator import KVBlocksAllocator

#: the sequence holding transformers' trash blocks (request ids are str)
TRASH_SEQ = -1


class KVBlocksCachePool(CachePool):
    """transformers' ``CachePool`` backed by a :class:`kvblocks.BlockPool`.

    transformers hands sectors to allocators and blocks out of sectors. Here the kvblocks pool spans
    every block of the cache tensor: all sectors count as assigned from the start (none is ever
    "free" at sector level), ``get_free_blocks`` allocates, ``free_blocks`` frees and
    ``count_free_blocks`` is kvblocks' ``num_free`` (never-cached free blocks plus evictable
    cached ones: allocation evicts those lazily, in LRU order, one at a time).

    With several allocators (full and sliding-window layers) every allocator's block holds the
    same number of pages (:func:`_pad_block`), so one kvblocks pool serves them all: the block
    tables live in one :class:`kvblocks.BlockManager`, one KV cache group per allocator.
    """

    def __init__(
        self, num_sectors: int, num_allocators: int, num_reserved_sectors: int = 2
    ) -> None:
        kb = context.active()
        if kb is None:
            raise InvalidStateError(
                "a kvblocks cache pool was built outside "
                "transformers_cb.enabled() (the block was left while "
                "transformers was building its cache)"
            )
        self.kb = kb
        self.peak = 0  # most blocks held by requests at once (KVBlocksCB.peak_blocks_in_use)
        self.kv: Optional[BlockPool] = None
        self.mgr: Optional[BlockManager] = None  # stage 2: the block tables' manager
        self.page_size = 0  # tokens per block, set by the allocator before the pool is built
        self.sharing = True  # transformers' allow_block_sharing (stage 2 reads it)
        self.reserved = np.empty(0, dtype=np.int32)
        self.allocators: List["KVBlocksAllocator"] = []
        super().__init__(num_sectors, num_allocators, num_reserved_sectors)

    def reset(self) -> None:
        """transformers' reset (after warmup, on ``cache.reset()``): every request is freed first.
        The prefix cache is kept: cached blocks still hold their K/V."""
        self.free_sectors = []  # every sector belongs to kvblocks from the start
        if self.kv is not None and self.kv.num_used != len(self.reserved):
            held = self.kv.num_used - len(self.reserved)
            raise InvalidStateError(f"cache pool reset while {held} blocks are still referenced")

    def set_blocks_per_sector(self, index: int, blocks_per_sector: int) -> None:
        """Called by each allocator once the cache tensor is registered; after the last one, builds
        the kvblocks pool over the whole tensor (every allocator's blocks have the same size)."""
        if self.kv is not None:
            raise InvalidStateError("the kvblocks cache pool is already set up")
        if any(b not in (0, blocks_per_sector) for b in self.blocks_per_sector):
            raise InvalidStateError(
                f"transformers_cb: allocators of one cache cut {self.blocks_per_sector} and "
                f"{blocks_per_sector} blocks per sector (their blocks must have one size)"
            )
        self.blocks_per_sector[index] = blocks_per_sector
        if len(self.allocators) == self.num_allocators:
            self._build(blocks_per_sector)

    def _build(self, blocks_per_sector: int) -> None:
        num_blocks = (self.num_sectors + self.num_reserved_sectors) * blocks_per_sector
        kb = self.kb
        kwargs: Dict[str, Any] = {
            "enable_prefix_caching": kb.enable_prefix_caching,
            "enable_kv_events": kb.enable_kv_events,
        }
        if kb.hash_key is not None:
            kwargs["hash_key"] = kb.hash_key
        allocators = sorted(self.allocators, key=lambda a: a.index)
        groups = tuple(a.kv_group for a in allocators)
        # the trash sectors' blocks keep transformers' ids: hold them (block 0 is kvblocks' null)
        n_trash = self.num_reserved_sectors * blocks_per_sector
        if kb.native_step or groups != (KVGroup("full"),):
            # stage 2, or any sliding-window layer: the block tables (one group per allocator) live
            # in a BlockManager; the trash is held by a sequence, split evenly over the groups
            kwargs["enable_prefix_caching"] = kb.enable_prefix_caching and self.sharing
            mgr = BlockManager(num_blocks, self.page_size, groups=groups, **kwargs)
            mgr.add(TRASH_SEQ, [])
            per_group = -(-(n_trash - 1) // len(groups))
            mgr.reserve(TRASH_SEQ, per_group * self.page_size)
            kv, self.mgr = mgr.pool, mgr
            reserved = np.sort(
                np.concatenate([mgr.block_table(TRASH_SEQ, group=g) for g in range(len(groups))])
            )
        else:
            kv = BlockPool(num_blocks, **kwargs)
            reserved = kv.allocate(n_trash - 1) if n_trash > 1 else np.empty(0, dtype=np.int32)
        if not np.array_equal(reserved, np.arange(1, len(reserved) + 1, dtype=np.int32)) or (
            len(reserved) < n_trash - 1
        ):
            raise InvalidStateError("kvblocks did not hand out the trash blocks first")
        self.kv, self.reserved = kv, reserved
        kb.pools.append(self)

    def note_usage(self) -> None:
        """Sample the blocks held by requests (for :attr:`KVBlocksCB.peak_blocks_in_use`)."""
        if self.kv is not None:
            self.peak = max(self.peak, self.kv.num_used - len(self.reserved))

    # sector level: nothing to do, kvblocks owns every block
    def allocate_sector(self, index: int) -> None:
        raise InvalidStateError("kvblocks cache pool: no sector is ever free")

    def try_to_free_sectors(self) -> None:
        pass

    # block level
    @property
    def _pool(self) -> BlockPool:
        assert self.kv is not None, "the pool is built with the cache tensor"
        return self.kv

    def get_free_blocks(self, index: int, num_blocks: int) -> List[int]:
        ids = self._pool.allocate(num_blocks).tolist()
        self.note_usage()
        return ids

    def free_blocks(self, index: int, block_ids: List[int]) -> None:
        if len(block_ids):
            self._pool.free(np.asarray(block_ids[::-1], dtype=np.int32))

    def count_free_blocks(self, index: int) -> int:
        """kvblocks' free blocks, given to allocator 0; the others see none (their needs are
        counted by allocator 0, which allocates for every group), so transformers' free-capacity
        sum over allocators counts each block once."""
        return self._pool.num_free if index == 0 else 0

    def check(self) -> None:
        """kvblocks' invariants, and reference counts equal to the block tables' references."""
        kv = self.kv
        if kv is None:
            return
        kv.check()
        if self.mgr is not None:
            self.mgr.check()
            if self.mgr.num_pending_copies:  # their sources hold a reference until drained
                return
        expected = np.zeros(kv.num_blocks, dtype=np.int64)
        expected[self.reserved] += 1
        for alloc in self.allocators:
            for table in alloc.block_table.values():
                t = np.asarray(table, dtype=np.int64)
                np.add.at(expected, t[t != 0], 1)  # 0: a window group's released entries
        actual = kv.ref_counts().astype(np.int64)
        bad = np.flatnonzero(expected != actual)
        if bad.size:
            b = int(bad[0])
            raise InvalidStateError(
                f"block {b}: ref count {int(actual[b])} but block tables hold "
                f"{int(expected[b])} references ({bad.size} blocks differ)"
            )

    def __repr__(self) -> str:
        return f"KVBlocksCachePool({self.kv!r})"
