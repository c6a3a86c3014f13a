"""transformers' full-attention allocator whose block bookkeeping is kvblocks' (stage 1: block
tables in transformers, blocks from a :class:`kvblocks.BlockPool`)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np

from ... import BlockPool, KVGroup, hash_blocks
from ...errors import InvalidStateError
from ...groups import layer_group
from .compat import FULL_ATTENTION, FullAttentionCacheAllocator, _cb_cache
from .pool import KVBlocksCachePool


class _NoLedger:
    """Stands in for transformers' ``BlockLedger``: kvblocks keeps ref counts, hashes and the
    cached-block LRU, and evicts lazily, so "evict every cached block" returns nothing."""

    def reset(self) -> None:
        pass

    def evict_cached_blocks(self) -> List[int]:
        return []


class KVBlocksAllocator(FullAttentionCacheAllocator):
    """transformers' full-attention allocator whose block bookkeeping is kvblocks'.

    transformers keeps the block tables (``block_table[request_id]``, lists of kvblocks ids) and
    computes the physical rows from them; kvblocks hands out, shares, caches and frees the ids.
    ``_chains[request_id]`` holds the hashes of the request's leading blocks registered so far
    (``(n, 2)`` uint64), so a newly computed block is hashed on its parent in one native call.
    """

    #: the manager-backed subclass a model with several attention kinds needs (KV cache groups
    #: live in a BlockManager); set by :mod:`.step`, which defines it on this class
    grouped: Optional[type] = None

    def __new__(cls, *args: Any, **kwargs: Any) -> "KVBlocksAllocator":
        # stage 1 keeps block tables in Python over a BlockPool; a model with sliding-window layers
        # needs KV cache groups, which live in a BlockManager: its full-attention allocator is the
        # manager-backed one then (transformers still builds the indices, from kvblocks' tables)
        if cls is KVBlocksAllocator and len(_attention_kinds(kwargs.get("config"))) > 1:
            assert KVBlocksAllocator.grouped is not None, "set by .step"
            cls = KVBlocksAllocator.grouped
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _pad_block(self, kwargs.get("config"))
        self.ledger = _NoLedger()  # type: ignore[assignment]  # transformers' ledger, unused
        self._chains: Dict[str, np.ndarray] = {}
        self.deduplicated = 0  # computed blocks replaced by an identical cached block
        self.dedup_lookups = [0, 0]  # [lookups, hits] made to de-duplicate (not prefix queries)
        self.hit_tokens = 0  # prompt tokens served from the prefix cache

    def _after_cache_tensor_init(
        self, non_trash_bytes: int, bytes_per_sector: int, cache_tensor: Any, pool: Any
    ) -> None:
        if not isinstance(pool, KVBlocksCachePool):
            raise InvalidStateError(
                "transformers_cb: the cache was built while leaving "
                "enabled(); build it inside the block"
            )
        pool.allocators.append(self)  # first: the last allocator's registration builds the pool
        super()._after_cache_tensor_init(non_trash_bytes, bytes_per_sector, cache_tensor, pool)

    @property
    def kv_group(self) -> KVGroup:
        """The KV cache group holding this allocator's block tables."""
        return layer_group(None)  # the integrations' one layer -> group mapper

    @property
    def kv(self) -> BlockPool:
        return self.pool.kv  # type: ignore[attr-defined]  # a KVBlocksCachePool (checked at init)

    def _caching(self) -> bool:
        return self.use_block_sharing and self.kv.enable_prefix_caching

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        """Release the request's blocks, tail first. ``no_cache`` (transformers' offload) is not
        needed: a cached block holds computed K/V, it stays a valid (evictable) prefix entry."""
        table = self.block_table.pop(request_id, [])
        self._chains.pop(request_id, None)
        if table:
            self.kv.free(np.asarray(table[::-1], dtype=np.int32))

    def fork_blocks(self, source_request_id: str, dest_request_id: str, past_length: int) -> tuple:
        """A child shares the parent's full blocks (``incref``) and gets fresh blocks for the rest,
        which transformers copies (the partial tail block)."""
        source = self.block_table[source_request_id]
        num_shared = self.count_shareable_blocks(source_request_id, past_length)
        shared, to_copy = source[:num_shared], source[num_shared:]
        fresh = self.kv.allocate(len(to_copy)).tolist()  # first: all or nothing
        if shared:
            self.kv.incref(np.asarray(shared, dtype=np.int32))
        self.block_table[dest_request_id] = shared + fresh
        chain = self._chains.get(source_request_id)
        if chain is not None:
            self._chains[dest_request_id] = chain[:num_shared].copy()
        return to_copy, fresh

    def match_prefix_blocks(self, prompt_ids: List[int]) -> List[int]:
        """Hash the prompt's full blocks (keeping at least one token to compute) and look them up
        and pin them in one native call. transformers acquires them next
        (:meth:`acquire_prefix_blocks`)."""
        if not self._caching():
            return []
        n = (len(prompt_ids) - 1) // self.tokens_per_page
        if n <= 0:
            return []
        hashes = hash_blocks(
            prompt_ids[: n * self.tokens_per_page], self.tokens_per_page, key=self.kv.hash_key
        )
        hit = self.kv.lookup_and_pin(hashes)
        if len(hit):
            self._pending_hit = (hit, hashes[: len(hit)])
        return hit.tolist()

    def acquire_prefix_blocks(self, request_id: str, prefix_len: int, block_ids: List[int]) -> None:
        """The request's table starts with the blocks :meth:`match_prefix_blocks` pinned."""
        hit, hashes = self.__dict__.pop("_pending_hit", (np.empty(0, np.int32), None))
        if hit.tolist() != list(block_ids) or self.block_table.get(request_id):
            if len(hit):
                self.kv.free(hit[::-1])
            raise InvalidStateError(
                f"prefix hit for request {request_id!r} does not match the blocks just looked up"
            )
        kept = prefix_len // self.tokens_per_page
        if kept < len(hit):  # another allocator matched less (not the case with one allocator)
            self.kv.free(hit[kept:][::-1])
        self.block_table[request_id] = hit[:kept].tolist()
        self._chains[request_id] = hashes[:kept].copy()
        self.hit_tokens += kept * self.tokens_per_page

    def mark_complete_blocks(
        self, request_id: str, token_ids: List[int], new_new_blocks: int
    ) -> None:
        """The forward pass that just returned computed ``new_new_blocks`` more full blocks of the
        request: hash them on their parent and register them in the prefix cache.

        A block whose hash is already cached under another block (two requests computed the same
        prefix in one step) is replaced by that block in the table and released, as transformers
        does, so identical K/V are held once."""
        if not self._caching():
            return
        table = self.block_table.get(request_id)
        if table is None:
            return
        chain = self._chains.get(request_id)
        done = 0 if chain is None else len(chain)
        ps = self.tokens_per_page
        end = min(done + new_new_blocks, len(token_ids) // ps, len(table))
        if end <= done:
            return
        parent = None if chain is None or done == 0 else chain[done - 1]
        tokens = np.asarray(token_ids[done * ps : end * ps], dtype=np.int32)
        new = hash_blocks(tokens, ps, parent=parent, key=self.kv.hash_key)
        ids = np.asarray(table[done:end], dtype=np.int32)
        kv = self.kv
        kv.cache(ids, new, parent=parent, token_ids=tokens if kv.record_events else None)
        for i, block in enumerate(ids.tolist()):
            if kv.is_cached(block):
                continue
            existing = kv.lookup(new[i : i + 1])  # same thread, nothing between lookup and incref
            self.dedup_lookups[0] += 1
            self.dedup_lookups[1] += len(existing)
            if len(existing) and int(existing[0]) != block:
                kv.incref(existing)
                table[done + i] = int(existing[0])
                kv.free(ids[i : i + 1])
                self.deduplicated += 1
        self._chains[request_id] = new if chain is None else np.concatenate([chain, new])


def _attention_kinds(config: Any) -> Dict[str, List[int]]:
    """transformers' grouping of the model's layers by attention type (its allocators)."""
    if config is None or _cb_cache is None:
        return {FULL_ATTENTION: []}
    return _cb_cache.group_layers_by_attn_type(config)


def _pad_block(alloc: Any, config: Any) -> None:
    """Give every allocator of the model blocks of the same size: as many pages as the largest
    attention kind has layers. transformers sizes each kind's block to its own layers and carves
    sectors into blocks of different sizes; kvblocks has one pool of one block size, shared by its
    groups. A kind with fewer layers leaves its extra pages unused (none when the kinds have equal
    layer counts: Gemma 2, gpt-oss, or a single kind)."""
    pages = max(len(v) for v in _attention_kinds(config).values()) if config is not None else 0
    if pages <= alloc.pages_per_block:
        return
    alloc.pages_per_block = pages
    alloc.tokens_per_block = alloc.tokens_per_page * pages
    alloc.block_physical_stride = alloc.rows_per_token * alloc.tokens_per_block
    alloc.bytes_per_block = alloc.bytes_per_page * pages
